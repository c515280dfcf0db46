"""The fork tree's rows, measured through a server's HTTP API: `diff_10_of_1gib` and
`apply_10_of_1gib` (a fork child that changed 10 files of a 1 GiB tree: its diff, and those
changes taken into the parent, each against a snapshot of the child in the same sample), and
`rollback` (a sandbox brought back in place to a memory snapshot of itself). See
bench/README.md for each row."""

from __future__ import annotations

from typing import Any

from .client import BenchError, Sbx
from .scenarios_common import PROBE_ID, RowsBase
from .scenarios_lifecycle import DIRTY_MEMORY_MB, DIRTY_TIMEOUT

DIFF_ROW = "diff_10_of_1gib"
APPLY_ROW = "apply_10_of_1gib"
ROLLBACK_ROW = "rollback"
FORKTREE_ROWS = [DIFF_ROW, APPLY_ROW, ROLLBACK_ROW]

TREE_DIR = "/var/tmp/aenv-bench-tree"
# A file the rollback row writes after the snapshot: gone again once rolled back.
ROLLBACK_MARK = "/var/tmp/aenv-bench-after-snapshot"


def tree_command(files: int, mib: int = 1, first: int = 0) -> str:
    """Writes `files` files of `mib` MiB of random bytes, `TREE_DIR/fNNNN` from number
    `first` (one python3 process: no program started per file)."""
    script = (
        "import os\n"
        f"os.makedirs({TREE_DIR!r}, exist_ok=True)\n"
        f"for i in range({first}, {first + files}):\n"
        f"    with open(f'{TREE_DIR}/f{{i:04d}}', 'wb') as f:\n"
        f"        f.write(os.urandom({mib << 20}))\n"
    )
    return f'python3 -c "{script}" && sync'


def changed_in_tree(changes: Any) -> int:
    """How many entries of a diff answer are changed files under `TREE_DIR`."""
    if not isinstance(changes, list):
        return -1
    return sum(
        1
        for c in changes
        if isinstance(c, dict)
        and str(c.get("path", "")).startswith(TREE_DIR + "/")
        and c.get("change") == "changed"
        and c.get("type") == "file"
    )


class ForkTreeRows(RowsBase):
    """diff and apply of a fork child's changes, rollback to a snapshot."""

    async def diff_apply_rows(self) -> None:
        rows = [r for r in (DIFF_ROW, APPLY_ROW) if self.want(r)]
        if not rows:
            return
        if not await self._route(rows, "diff", "GET", f"/sandboxes/{PROBE_ID}/diff"):
            return
        if APPLY_ROW in rows and not await self._route(
            [APPLY_ROW], "apply", "POST", f"/sandboxes/{PROBE_ID}/apply"
        ):
            rows.remove(APPLY_ROW)
            if not rows:
                return
        p = self.plan
        self.progress.step(f"{DIFF_ROW}: the parent's {p.tree_files} MiB tree", 1)
        try:
            parent, _, _ = await self.create_and_exec(memory_mb=DIRTY_MEMORY_MB)
        except BenchError as exc:
            self.results.missing(rows, f"could not create the parent: {exc}")
            self.progress.advance()
            return
        try:
            try:
                await self.api.run(parent, tree_command(p.tree_files), timeout=600)
            except BenchError as exc:
                self.results.missing(rows, f"could not write the parent's tree: {exc}")
                return
            finally:
                self.progress.advance()
            self.progress.step(DIFF_ROW if DIFF_ROW in rows else APPLY_ROW, p.forktree)

            async def one(_i: int) -> None:
                await self._diff_apply_once(parent, rows)

            await self.loop(rows, p.forktree, one)
        finally:
            await self._release([parent])
        for row in [r for r in rows if self.results.has_samples(r)]:
            self.results.note(
                row,
                f"a parent ({DIRTY_MEMORY_MB} MiB) holding {p.tree_files} files of 1 MiB, "
                f"forked once per sample; the child rewrites {p.tree_changed} of them; "
                "baseline: a snapshot of that child, in the same sample",
            )

    async def _diff_apply_once(self, parent: Sbx, rows: list[str]) -> None:
        p = self.plan
        children, errors, _ = await self.api.fork(parent.sandbox_id, 1)
        try:
            if errors or len(children) != 1:
                raise BenchError(f"fork: {len(children)}/1 child made {errors[:1]}")
            child = children[0]
            await self.api.run(child, tree_command(p.tree_changed), timeout=120)
            snap, base = await self.api.snapshot(child.sandbox_id, timeout=DIRTY_TIMEOUT)
            await self._delete_snapshot(rows[0], snap)
            await self.settle()
            for row in rows:
                self.results.add(row, base.ms, base.stages, baseline=True)
            if DIFF_ROW in rows:
                d = await self.api.diff(child.sandbox_id, timeout=DIRTY_TIMEOUT)
                found = changed_in_tree(d.data)
                if found != p.tree_changed:
                    raise BenchError(
                        f"diff: {found} changed files of the tree, not {p.tree_changed}"
                    )
                self.results.add(DIFF_ROW, d.ms, d.stages)
            if APPLY_ROW in rows:
                a = await self.api.apply(parent.sandbox_id, child.sandbox_id, timeout=DIRTY_TIMEOUT)
                got = a.data.get("applied") if isinstance(a.data, dict) else None
                found = changed_in_tree(got)
                if found != p.tree_changed:
                    raise BenchError(
                        f"apply: {found} files of the tree taken, not {p.tree_changed}"
                    )
                self.results.add(APPLY_ROW, a.ms, a.stages)
        finally:
            await self._quiet_kill(children)

    async def rollback_row(self) -> None:
        row = ROLLBACK_ROW
        if not self.want(row):
            return
        if not await self._route([row], "rollback", "POST", f"/sandboxes/{PROBE_ID}/rollback"):
            return
        try:
            sbx, _, _ = await self.create_and_exec()
        except BenchError as exc:
            self.results.missing([row], f"could not create a sandbox: {exc}")
            return
        snap: str | None = None
        try:
            try:
                snap, _ = await self.api.snapshot(sbx.sandbox_id, timeout=DIRTY_TIMEOUT)
            except BenchError as exc:
                self.results.missing([row], f"could not snapshot the sandbox: {exc}")
                return
            self.progress.step(row, self.plan.rollback)

            async def one(i: int, snap: str = snap) -> tuple[float, dict[str, float]]:
                await self.api.run(sbx, f"echo {i} > {ROLLBACK_MARK}")
                # The snapshot's publish, the last sample's old container: not this one's.
                await self.settle()
                t = await self.api.rollback(sbx.sandbox_id, snap)
                # It answers again, and what was written after the snapshot is gone (untimed).
                await self.api.run(sbx, f"test ! -e {ROLLBACK_MARK}")
                return t.ms, t.stages

            await self.loop([row], self.plan.rollback, one)
        finally:
            await self._release([sbx])
            if snap is not None:
                await self._delete_snapshot(row, snap)
        if self.results.has_samples(row):
            self.results.note(
                row,
                "one memory snapshot of a default-size sandbox, rolled back to once per "
                "sample after a file was written; target relative to resume_from_disk "
                "(the cold server's), not judged without it",
            )
