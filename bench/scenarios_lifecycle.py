"""The rows of one sandbox's lifecycle, measured through a server's HTTP API: create, exec,
files, pause/resume, hibernate, snapshots and fork (see bench/README.md for each row)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from . import hostdisk, hostproc
from .client import Abort, BenchError, Missing, Sbx, random_payload
from .scenarios_common import POOL_REFILL_WAIT, PROBE_ID, RowsBase

# The rows measured on one long-lived sandbox (`running_sandbox_rows`).
RUNNING_ROWS = [
    "exec_roundtrip",
    "spawn_in_sandbox",
    "file_write_1mib",
    "file_read_1mib",
    "pause",
    "resume",
    "snapshot",
]

FILE_PATH = "/tmp/aenv-bench-1mib"
FILE_SIZE = 1 << 20
DIRTY_DIR = "/var/tmp/aenv-bench-dirty"
DIRTY_MEMORY_MB = 2048
# Seconds the snapshot of a sandbox that just wrote 1 GiB may take.
DIRTY_TIMEOUT = 120.0
SPAWN_FLOOR_PATH = "/tmp/aenv-bench-spawn.py"
# Times N spawns of what every exec spawns; argv: N, where to write the samples (JSON).
SPAWN_FLOOR = """import json, subprocess, sys, time
out = []
for _ in range(int(sys.argv[1]) + 2):
    t = time.perf_counter()
    subprocess.run(["/bin/bash", "-l", "-c", "true"], check=True)
    out.append((time.perf_counter() - t) * 1000)
with open(sys.argv[2], "w") as f:
    json.dump(out[2:], f)
"""


# snapshot_after_1000_cmds: `n` short processes, each reading its own /proc/<pid>/stat (the
# pattern that once left every dead process in the checkpoint), from one envd command.
CMDS_ROW = "snapshot_after_1000_cmds"
CMDS_MIB_ROW = "snapshot_after_1000_cmds_mib"


def cmds_command(n: int, form: str = "exec") -> str:
    """`exec`: n × `sh -c 'cat /proc/$$/stat'` (programs started, ~50 ms each in gVisor);
    `fork`: n forked subshells reading their own stat (no exec, ~15 ms each)."""
    if form == "fork":
        return f"for i in $(seq {n}); do ( read -r _ < /proc/$BASHPID/stat ); done"
    return f"for i in $(seq {n}); do sh -c 'cat /proc/$$/stat >/dev/null'; done"


def dirty_command(mib: int) -> str:
    """Shell command writing `mib` MiB of incompressible data as 64 MiB files (one random
    seed file, copied: fast in gVisor, and not zero pages a checkpoint could skip)."""
    chunk = 64
    copies = max(0, mib // chunk - 1)
    return (
        f"mkdir -p {DIRTY_DIR} && cd {DIRTY_DIR} && head -c {chunk}M /dev/urandom > f0"
        f" && for i in $(seq {copies}); do cat f0 > f$i; done; sync"
    )


def reports_hibernated(detail: Any) -> bool:
    """Whether a `GET /sandboxes/{id}` answer says the sandbox is hibernated (on disk): any
    key mentioning "hibernat" with a true value, or any string value mentioning it."""
    if isinstance(detail, dict):
        for key, value in detail.items():
            if "hibernat" in str(key).lower() and value not in (False, None, "", 0):
                return True
            if reports_hibernated(value):
                return True
        return False
    if isinstance(detail, list):
        return any(reports_hibernated(v) for v in detail)
    return isinstance(detail, str) and "hibernat" in detail.lower()


class LifecycleRows(RowsBase):
    """create, exec, files, pause/resume, hibernate, snapshots, fork."""

    async def create_rows(self, row: str, n: int) -> None:
        if not self.want(row):
            return
        self.progress.step(row, n)

        async def one(i: int) -> tuple[float, dict[str, float]]:
            if i and row == "create_to_first_exec":
                # The row is the warm-pool path: give the pool (2 by default) time to refill
                # (a boot and a warm-up, ~0.5 s); back-to-back creates are the concurrent rows.
                await asyncio.sleep(POOL_REFILL_WAIT)
            sbx, total, stages = await self.create_and_exec()
            await self.kill([sbx])
            return total, stages

        await self.loop([row], n, one)

    async def _spawn_floor(self, sbx: Sbx) -> None:
        """The floor under exec_roundtrip: the same `bash -l -c true`, spawned inside the
        sandbox by a process already running as the same user (no envd, no network, no
        credential switch), timed in there."""
        n = self.plan.exec
        self.progress.step("spawn_in_sandbox", n)
        out = SPAWN_FLOOR_PATH + ".json"
        try:
            await self.api.write_file(sbx, SPAWN_FLOOR_PATH, SPAWN_FLOOR.encode())
            await self.api.run(sbx, f"python3 {SPAWN_FLOOR_PATH} {n} {out}", timeout=120)
            got = await self.api.read_file(sbx, out)
            samples = [float(x) for x in json.loads(got.data)]
        except (BenchError, ValueError, TypeError) as exc:
            self.results.missing(["spawn_in_sandbox"], f"could not measure: {exc}")
            return
        for ms in samples:
            self.results.add("spawn_in_sandbox", ms)
            self.progress.advance()

    async def running_sandbox_rows(self) -> None:
        """exec, files, pause/resume and snapshot, on one long-lived sandbox."""
        rows = RUNNING_ROWS
        if not any(self.want(r) for r in rows):
            return
        p = self.plan
        try:
            sbx, _, _ = await self.create_and_exec()
        except BenchError as exc:
            self.results.missing(
                [r for r in rows if self.want(r)], f"could not create a sandbox: {exc}"
            )
            return
        try:
            if self.want("exec_roundtrip"):
                self.progress.step("exec_roundtrip", p.exec)
                for _ in range(2):
                    await self.api.run(sbx)

                async def run(_i: int) -> tuple[float, dict[str, float]]:
                    t = await self.api.run(sbx)
                    return t.ms, t.stages

                await self.loop(["exec_roundtrip"], p.exec, run)

            if self.want("spawn_in_sandbox"):
                await self._spawn_floor(sbx)

            if self.want("file_write_1mib") or self.want("file_read_1mib"):
                data = random_payload(FILE_SIZE)
                self.progress.step("file_write_1mib", p.files)

                async def write(_i: int) -> tuple[float, dict[str, float]]:
                    t = await self.api.write_file(sbx, FILE_PATH, data)
                    return t.ms, t.stages

                await self.loop(["file_write_1mib"], p.files, write)
                if self.want("file_read_1mib"):
                    self.progress.step("file_read_1mib", p.files)
                    await self.api.write_file(sbx, FILE_PATH, data)

                    async def read(_i: int) -> tuple[float, dict[str, float]]:
                        t = await self.api.read_file(sbx, FILE_PATH, expect=FILE_SIZE)
                        return t.ms, t.stages

                    await self.loop(["file_read_1mib"], p.files, read)

            if self.want("pause") or self.want("resume"):
                await self._pause_resume(sbx)

            if self.want("snapshot"):
                await self._snapshots(sbx)
        finally:
            await self._release([sbx])

    async def _pause_resume(self, sbx: Sbx) -> None:
        self.progress.step("pause/resume", self.plan.pause)

        async def one(_i: int) -> None:
            paused = await self.api.pause(sbx.sandbox_id)
            self.results.add("pause", paused.ms, paused.stages)
            try:
                resumed = await self.api.resume(sbx.sandbox_id)
            except Missing as exc:
                self.results.missing(["resume"], str(exc))
                raise Abort(str(exc)) from None
            except BenchError as exc:  # still paused: the next pause would fail too
                raise Abort(str(exc)) from None
            if resumed.status != 201:
                self.results.note("resume", f"connect answered {resumed.status}, not 201")
            self.results.add("resume", resumed.ms, resumed.stages)
            await self.api.run(sbx)  # it answers again (untimed)

        await self.loop(["pause", "resume"], self.plan.pause, one)

    async def _snapshots(self, sbx: Sbx) -> None:
        self.progress.step("snapshot", self.plan.snapshot)

        async def one(_i: int) -> None:
            snap, t = await self.api.snapshot(sbx.sandbox_id)
            self.results.add("snapshot", t.ms, t.stages)
            await self._delete_snapshot("snapshot", snap)
            await self.api.run(sbx)  # it still answers (untimed)

        await self.loop(["snapshot"], self.plan.snapshot, one)
        if not self.results.has_samples("snapshot"):
            self.results.missing(
                ["snapshot_dirty_1gib"], "skipped: no snapshot succeeded (see the snapshot row)"
            )

    async def dirty_snapshot(self) -> None:
        row = "snapshot_dirty_1gib"
        if not self.want(row) or self.results.series(row).missing:
            return
        p = self.plan
        if not await self._route([row], "snapshot", "POST", f"/sandboxes/{PROBE_ID}/snapshots"):
            return
        self.progress.step(row, p.dirty)
        command = dirty_command(p.dirty_mib)

        async def one(_i: int) -> None:
            sbx, _, _ = await self.create_and_exec(memory_mb=DIRTY_MEMORY_MB)
            try:
                wrote = await self.api.run(sbx, command, timeout=600)
                snap, t = await self.api.snapshot(sbx.sandbox_id, timeout=DIRTY_TIMEOUT)
                self.results.add(row, t.ms, {**t.stages, "write_in_sandbox": wrote.ms})
                await self._delete_snapshot(row, snap)
            finally:
                await self._quiet_kill([sbx])

        await self.loop([row], p.dirty, one)

    async def cmds_snapshot(self) -> None:
        """snapshot_after_1000_cmds (time) and _mib (memory image size): two sandboxes, one
        fresh and one that ran `plan.cmds` processes and `plan.cmds_envd` envd commands;
        each sample snapshots both, the fresh one being the rows' baseline."""
        rows = [CMDS_ROW, CMDS_MIB_ROW]
        if not any(self.want(r) for r in rows):
            return
        if not await self._route(rows, "snapshot", "POST", f"/sandboxes/{PROBE_ID}/snapshots"):
            return
        p = self.plan
        if self.home is None:
            self.results.missing(
                [CMDS_MIB_ROW],
                "the image size is read host-side: only for a server the bench started",
            )
        made: list[Sbx] = []
        try:
            self.progress.step(f"{CMDS_ROW}: {p.cmds} processes", 1)
            try:
                for _ in range(2):
                    made.append((await self.create_and_exec())[0])
                fresh, used = made
                ran = await self.api.run(used, cmds_command(p.cmds, p.cmds_form), timeout=600)
                t0 = time.perf_counter()
                for _ in range(p.cmds_envd):
                    await self.api.run(used, "cat /proc/self/stat >/dev/null")
                envd_ms = (time.perf_counter() - t0) * 1000
            except BenchError as exc:
                self.results.missing(rows, f"could not prepare the sandboxes: {exc}")
                return
            finally:
                self.progress.advance()
            self.progress.step(CMDS_ROW, p.cmds_snapshot)

            async def snap(sbx: Sbx, *, baseline: bool) -> None:
                snap_id, t = await self.api.snapshot(sbx.sandbox_id, timeout=DIRTY_TIMEOUT)
                mib = None
                if self.home is not None:
                    mib = await asyncio.to_thread(hostdisk.snapshot_image_mib, self.home, snap_id)
                await self._delete_snapshot(CMDS_ROW, snap_id)
                stages = dict(t.stages)
                if not baseline:
                    stages.update(cmds_in_sandbox=ran.ms, envd_cmds=envd_ms)
                self.results.add(CMDS_ROW, t.ms, stages, baseline=baseline)
                if mib is not None:
                    self.results.add(CMDS_MIB_ROW, mib, baseline=baseline)
                elif self.home is not None:
                    self.results.note(CMDS_MIB_ROW, f"no image found for snapshot {snap_id}")

            async def one(_i: int) -> None:
                await snap(fresh, baseline=True)
                await snap(used, baseline=False)

            await self.loop(rows, p.cmds_snapshot, one)
        finally:
            await self._release(made)
        what = (
            "`sh -c 'cat /proc/$$/stat'`"
            if p.cmds_form == "exec"
            else "forked subshells reading /proc/$BASHPID/stat (quick mode: no exec, faster)"
        )
        for row in [r for r in rows if self.results.has_samples(r)]:
            self.results.note(
                row,
                f"ours: a sandbox that ran {p.cmds} × {what} and {p.cmds_envd} envd commands; "
                "baseline: a fresh sandbox, snapshotted alternately in the same run",
            )

    async def fork_rows(self) -> None:
        rows = [r for r in ("fork_1", "fork_4", "fork_16") if self.want(r)]
        if not rows:
            return
        counts = {
            "fork_1": self.plan.fork_1,
            "fork_4": self.plan.fork_4,
            "fork_16": self.plan.fork_16,
        }
        if not await self._route(rows, "fork", "POST", f"/sandboxes/{PROBE_ID}/fork"):
            return
        try:
            source, _, _ = await self.create_and_exec()
        except BenchError as exc:
            self.results.missing(rows, f"could not create the fork source: {exc}")
            return
        try:
            for i, row in enumerate(rows):
                n = int(row.split("_")[1])
                self.progress.step(row, counts[row])

                async def one(_i: int, n: int = n) -> tuple[float, dict[str, float]]:
                    return await self._fork_once(source, n)

                await self.loop([row], counts[row], one)
                missing = self.results.series(row).missing
                if missing:
                    self.results.missing(rows[i + 1 :], missing)
                    return
                if not self.results.has_samples(row):  # the source may be gone as well
                    self.results.missing(rows[i + 1 :], f"skipped: no {row} succeeded")
                    return
        finally:
            await self._release([source])

    async def _fork_once(self, source: Sbx, n: int) -> tuple[float, dict[str, float]]:
        t0 = time.perf_counter()
        children, errors, t = await self.api.fork(source.sandbox_id, n)
        try:
            answers = await asyncio.gather(
                *(self.api.run(c, timeout=self.plan.child_timeout) for c in children),
                return_exceptions=True,
            )
            total = (time.perf_counter() - t0) * 1000
        finally:
            await self._quiet_kill(children)
        bad = [a for a in answers if isinstance(a, BaseException)]
        if errors or bad or len(children) != n:
            first = errors[0] if errors else (str(bad[0]) if bad else "")
            raise BenchError(
                f"{len(children)}/{n} children made, {len(bad)} did not answer {first}"
            )
        return total, {**t.stages, "http_fork": t.ms}

    async def hibernate_rows(self) -> None:
        rows = ["hibernate", "resume_from_disk"]
        if not any(self.want(r) for r in rows):
            return
        try:
            sbx, _, _ = await self.create_and_exec()
        except BenchError as exc:
            self.results.missing(rows, f"could not create a sandbox: {exc}")
            return
        self.progress.step("hibernate/resume_from_disk", self.plan.hibernate)

        async def one(_i: int) -> None:
            pids: list[int] = []
            if self.local:
                found = await asyncio.to_thread(hostproc.scan, [sbx.sandbox_id])
                pids = found[sbx.sandbox_id].main
            t0 = time.perf_counter()
            paused = await self.api.pause(sbx.sandbox_id)
            how = await self._wait_hibernated(sbx, pids)
            hibernated = (time.perf_counter() - t0) * 1000
            if how is None:
                with_note = (
                    f"not hibernated {self.plan.hibernate_wait:g}s after pause "
                    "(no hibernation in GET /sandboxes/{id}, sandbox process still running)"
                )
                await self.api.resume(sbx.sandbox_id)
                raise Missing("hibernate", 0, with_note)
            self.results.add("hibernate", hibernated, {**paused.stages, "http_pause": paused.ms})
            self.results.note("hibernate", f"hibernation seen by: {how}")
            try:
                resumed = await self.api.resume(sbx.sandbox_id)
            except BenchError as exc:
                raise Abort(f"resume of the hibernated sandbox: {exc}") from None
            if resumed.status != 201:
                self.results.note("resume_from_disk", f"connect answered {resumed.status}, not 201")
            self.results.add("resume_from_disk", resumed.ms, resumed.stages)
            await self.api.run(sbx)

        try:
            await self.loop(rows, self.plan.hibernate, one)
        finally:
            await self._release([sbx])

    async def _wait_hibernated(self, sbx: Sbx, pids: list[int]) -> str | None:
        """How the hibernation was seen ("api" or "host"), or None on time-out."""
        deadline = time.monotonic() + self.plan.hibernate_wait
        next_get = 0.0
        while time.monotonic() < deadline:
            if pids and not hostproc.any_alive(pids):
                return "host (the sandbox's runsc processes exited)"
            now = time.monotonic()
            if now >= next_get:
                next_get = now + 0.05
                try:
                    if reports_hibernated(await self.api.get(sbx.sandbox_id)):
                        return "api (GET /sandboxes/{id})"
                except BenchError:
                    pass
            await asyncio.sleep(0.005)
        return None
