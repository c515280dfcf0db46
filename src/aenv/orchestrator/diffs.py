"""Diff and apply between sandboxes (docs/fork-tree.md): what a sandbox changed since a base
— its fork point, a snapshot, another sandbox — and taking another sandbox's changes into a
running one. The files are read on the host from the layer stacks (`images/treediff.py`); a
running sandbox is asked to `sync` first, so what it wrote is in its upper."""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import functools
import logging
import secrets
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from ..domain import SandboxRecord, SandboxState, Timings
from ..envd.unpack import DELETE_MEMBER
from ..errors import AenvError, BadRequest, Conflict, NotFound, PathConflict
from ..images.overlay import lookup
from ..images.treediff import (
    Change,
    changed_among,
    diff_stacks,
    differ,
    tar_file,
    write_tar,
)
from ..runtime.base import Runtime
from ..threadstream import produced
from .context import NodeContext
from .envd_pool import EnvdPool
from .storage import SandboxStorage
from .table import SandboxTable
from .templates import TemplateRegistry

log = logging.getLogger("aenv.orchestrator")

FORK_POINT = "fork-point"
Strategy = Literal["ours", "theirs"]


@dataclass
class Applied:
    """What an apply did: the changes it took, and the paths both sides had changed (taken
    from the source with "theirs", left as they were with "ours")."""

    changes: list[Change]
    conflicts: list[str] = field(default_factory=list)


def _within(path: str, paths: Sequence[str]) -> bool:
    for p in paths:
        p = "/" + p.strip("/")
        if path == p or path.startswith(p.rstrip("/") + "/") or fnmatch.fnmatch(path, p):
            return True
    return False


@dataclass
class TreeDiffs:
    ctx: NodeContext
    table: SandboxTable
    templates: TemplateRegistry
    storage: SandboxStorage
    envd: EnvdPool
    runtime: Runtime

    # -- stacks -------------------------------------------------------------------------

    def _layers(self, digests: Sequence[str], what: str) -> list[Path]:
        missing = [d for d in digests if not self.storage.layers.has(d)]
        if missing:
            raise Conflict(f"the files of {what} are no longer kept on this node")
        return [self.storage.layers.path(d) for d in digests]

    async def _files(self, r: SandboxRecord) -> list[Path]:
        """A sandbox's files as a stack (its upper on top), what it wrote flushed."""
        if r.state is SandboxState.RUNNING and r.address is not None:
            await self._sync(r)
        elif r.state is not SandboxState.PAUSED:
            raise Conflict(f"sandbox {r.sandbox_id!r} is {r.state}")
        upper = [Path(r.upper)] if r.upper is not None else []
        if upper and not upper[0].is_dir():
            raise Conflict(f"the files of sandbox {r.sandbox_id!r} are not on this node")
        return upper + self._layers(r.layers, f"sandbox {r.sandbox_id!r}")

    async def _sync(self, r: SandboxRecord) -> None:
        assert r.address is not None
        envd = self.envd.at(r.address, r.envd_access_token)
        try:
            if not await envd.sync():
                await envd.run("/bin/sync", [], user="root", timeout=60)
        except (AenvError, httpx.HTTPError) as e:
            log.warning("sync in %s before a diff: %s", r.sandbox_id, e)
        if r.instance is not None:
            await self.runtime.sync_files(r.instance)

    async def _base(self, r: SandboxRecord, base: str | None) -> list[Path]:
        if base in (None, "", FORK_POINT):
            if not r.fork_layers:
                raise BadRequest(
                    f"sandbox {r.sandbox_id!r} has no fork point: give base=<sandbox or "
                    "snapshot id>"
                )
            return self._layers(r.fork_layers, f"the fork point of {r.sandbox_id!r}")
        assert base is not None
        other = self.table.find(base)
        if other is not None:
            await self.ctx.wake(other.sandbox_id)
            return await self._files(self.table.get(base))
        snap = await self.templates.find(base)
        if snap is None:
            raise NotFound(f"base {base!r} is neither a sandbox, a snapshot nor a template")
        return self._layers(snap.layers, f"{base!r}")

    # -- diff ---------------------------------------------------------------------------

    async def diff(
        self, sandbox_id: str, base: str | None, exclude: Sequence[str], t: Timings | None = None
    ) -> list[Change]:
        """What the sandbox changed relative to `base` (default its fork point)."""
        t = t or Timings()
        await self.ctx.wake(sandbox_id)
        async with self.table.lock(sandbox_id):
            r = self.table.get(sandbox_id)
            with t.stage("sync"):
                new = await self._files(r)
                old = await self._base(r, base)
            with t.stage("diff"):
                return await asyncio.to_thread(diff_stacks, new, old, exclude)

    # -- apply --------------------------------------------------------------------------

    async def apply(
        self,
        target_id: str,
        source_id: str,
        base: str | None,
        paths: Sequence[str],
        exclude: Sequence[str],
        strategy: Strategy | None,
        t: Timings | None = None,
    ) -> Applied:
        """The source's changes since `base` (default the source's fork point) written into
        the running target; paths both changed since then are refused (409, listed) unless
        a strategy says whose to keep."""
        if target_id == source_id:
            raise BadRequest("a sandbox cannot apply its own changes")
        t = t or Timings()
        await self.ctx.wake(target_id)
        await self.ctx.wake(source_id)
        async with self.table.lock(target_id):
            target = self.table.get(target_id)
            if target.state is not SandboxState.RUNNING or target.address is None:
                raise Conflict(f"sandbox {target_id!r} must be running to take changes")
            source = self.table.get(source_id)
            with t.stage("sync"):
                src_files, dst_files = await asyncio.gather(
                    self._files(source), self._files(target)
                )
                # The target as the base: its files were just read (and synced).
                old = dst_files if base == target_id else await self._base(source, base)
            with t.stage("diff"):
                theirs = await asyncio.to_thread(diff_stacks, src_files, old, exclude)
                if paths:
                    theirs = [c for c in theirs if _within(c.path, paths)]
                # Only the paths the source changed are looked at in the target: the cost
                # is the source's change, not what the target changed elsewhere.
                conflicts = await asyncio.to_thread(_conflicts, theirs, old, src_files, dst_files)
            if conflicts and strategy is None:
                raise PathConflict(
                    f"{len(conflicts)} path(s) changed in both {source_id!r} and {target_id!r} "
                    'since the base; give "strategy": "ours" or "theirs"',
                    conflicts,
                )
            skip = set(conflicts) if strategy == "ours" else set()
            take = [c for c in theirs if c.path not in skip]
            with t.stage("write"):
                await self._write(target, take)
            return Applied(take, conflicts)

    async def _write(self, target: SandboxRecord, changes: list[Change]) -> None:
        """Deletions, then the added and changed entries, as one tar envd unpacks as root
        (`envd/unpack.py`), sent as it is written; an older envd gets the tar as a file and
        `tar` unpacks it."""
        assert target.address is not None
        envd = self.envd.at(target.address, target.envd_access_token)
        body = produced(functools.partial(write_tar, changes, delete_member=DELETE_MEMBER))
        if await envd.unpack(body):
            return
        gone = [c.path for c in changes if c.change == "deleted"]
        put = [c for c in changes if c.change != "deleted"]
        script = []
        if gone:
            script.append("rm -rf -- " + " ".join(shlex.quote(p) for p in gone))
        name = f"/tmp/.aenv-apply-{secrets.token_hex(6)}.tar"
        if put:
            with await asyncio.to_thread(tar_file, put) as tar:
                await envd.upload(name, tar, user="root", filename="apply.tar")
            script.append(f"tar -xpf {name} -C / --numeric-owner; s=$?; rm -f {name}; exit $s")
        if not script:
            return
        end = await envd.run("/bin/sh", ["-c", "\n".join(script)], user="root", timeout=300)
        if end.exit_code != 0:
            raise AenvError(f"applying the changes failed in the sandbox: {end.status}")


def _conflicts(
    theirs: list[Change], base: list[Path], src: list[Path], dst: list[Path]
) -> list[str]:
    """Paths both changed since `base`, but not to the same thing."""
    ours = changed_among(dst, base, [c.path for c in theirs])
    found = []
    for c in theirs:
        if c.path not in ours:
            continue
        rel = c.path.lstrip("/")
        a, b = lookup(src, rel), lookup(dst, rel)
        if a is None and b is None:
            continue
        with contextlib.suppress(OSError):
            if a is not None and b is not None and not differ(a, b):
                continue
        found.append(c.path)
    return found
