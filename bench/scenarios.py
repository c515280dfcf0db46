"""The rows measured through a server's HTTP API (see bench/README.md for each definition).

Every row is robust to a server that lacks the operation (`Missing`: the row is recorded as
missing with the server's answer, the rest goes on) and to failed samples (noted, skipped).
Sandboxes are removed by id as soon as a row is done; `Api.cleanup` removes the rest.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from . import hostproc
from .client import Abort, Api, BenchError, Missing, Sbx, random_payload
from .plan import Plan, Progress
from .stats import Results

FILE_PATH = "/tmp/aenv-bench-1mib"
FILE_SIZE = 1 << 20
DIRTY_DIR = "/var/tmp/aenv-bench-dirty"
DIRTY_MEMORY_MB = 2048
CONCURRENT_MEMORY_MB = 256
SETTLE_TIMEOUT = 20.0
# Seconds the snapshot of a sandbox that just wrote 1 GiB may take.
DIRTY_TIMEOUT = 120.0
# A sandbox id no server has: asking about it tells whether a route exists, harmlessly.
PROBE_ID = "aenv-bench-no-such-sandbox"
POOL_REFILL_WAIT = 1.5
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

SampleFn = Callable[[int], Awaitable[tuple[float, dict[str, float]] | None]]


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


async def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    """Polls `condition` until it holds (True) or `timeout` seconds passed (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)


async def sample_loop(
    results: Results,
    rows: list[str],
    n: int,
    fn: SampleFn,
    progress: Progress,
    *,
    baseline: bool = False,
    max_failures: int = 3,
) -> bool:
    """Runs `fn(i)` n times, adding each returned (ms, stages) to rows[0] (a sample may add
    to the other rows itself). A `Missing` marks every row in `rows` missing and stops
    (returns False); other failures are noted on every row, and after `max_failures` in a
    row, or an `Abort`, the loop gives up."""
    failed = 0
    in_a_row = 0

    def note(text: str) -> None:
        for row in rows:
            results.note(row, text, baseline=baseline)

    for i in range(n):
        try:
            got = await fn(i)
        except Missing as exc:
            results.missing(rows, str(exc), baseline=baseline)
            progress.advance(n - i)
            return False
        except BenchError as exc:
            failed += 1
            in_a_row += 1
            note(f"failed: {exc}")
            progress.advance()
            if in_a_row >= max_failures or isinstance(exc, Abort):
                if n - i - 1:
                    note(f"stopped after {failed} of {n} samples failed")
                progress.advance(n - i - 1)
                return False
            continue
        in_a_row = 0
        if got is not None:
            results.add(rows[0], got[0], got[1], baseline=baseline)
        progress.advance()
    if failed:
        note(f"{failed} of {n} samples failed")
    return True


class ServerRows:
    """The rows of one server. `local`: the server runs on this host (its runsc processes
    can be found, for memory and to know when a killed or hibernated sandbox is gone)."""

    def __init__(
        self,
        api: Api,
        results: Results,
        plan: Plan,
        progress: Progress,
        *,
        want: Callable[[str], bool],
        local: bool = True,
    ) -> None:
        self.api = api
        self.results = results
        self.plan = plan
        self.progress = progress
        self.want = want
        self.local = local
        self._troubled = False  # a row failed since the last `_release`
        self._bg: set[asyncio.Task[None]] = set()

    # -- helpers ------------------------------------------------------------------------------

    async def create_and_exec(
        self, memory_mb: int | None = None
    ) -> tuple[Sbx, float, dict[str, float]]:
        t0 = time.perf_counter()
        sbx, created = await self.api.create(memory_mb=memory_mb)
        ran = await self.api.run(sbx)
        total = (time.perf_counter() - t0) * 1000
        stages = dict(created.stages)
        stages["http_create"] = created.ms
        stages["first_exec"] = ran.ms
        return sbx, total, stages

    async def kill(self, sandboxes: Iterable[Sbx | str]) -> None:
        """Kills, then waits until their host processes are gone (so the next sample does
        not share the CPU with a teardown)."""
        ids = [s.sandbox_id if isinstance(s, Sbx) else s for s in sandboxes]
        if not ids:
            return
        pids: list[int] = []
        if self.local:
            found = await asyncio.to_thread(hostproc.scan, ids)
            pids = [p for procs in found.values() for p in procs.main]
        results = await asyncio.gather(*(self.api.kill(i) for i in ids), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if pids:
            await wait_until(lambda: not hostproc.any_alive(pids), SETTLE_TIMEOUT)
        if errors:
            raise BenchError(f"kill failed: {errors[0]}")

    async def _release(self, sandboxes: list[Sbx]) -> None:
        """Kills a row's sandboxes. After a failed row the server may still be busy with them
        (holding their lock until its own time-out), so then the kill goes on in the
        background instead of holding up the next row; `drain()` awaits it."""
        if not self._troubled:
            await self._quiet_kill(sandboxes)
            return
        self._troubled = False
        task = asyncio.create_task(self._quiet_kill(sandboxes))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def drain(self) -> None:
        """Awaits the kills `_release` left running."""
        while self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)

    async def _quiet_kill(self, sandboxes: Iterable[Sbx | str]) -> None:
        try:
            await self.kill(sandboxes)
        except BenchError as exc:
            self.progress.log(str(exc))

    async def loop(self, rows: list[str], n: int, fn: SampleFn) -> bool:
        ok = await sample_loop(
            self.results, rows, n, fn, self.progress, max_failures=self.plan.max_failures
        )
        if not ok:
            self._troubled = True
        return ok

    async def _delete_snapshot(self, row: str, snapshot_id: str) -> None:
        """Untimed; a failure is noted (the id stays listed for the final clean-up)."""
        try:
            await self.api.delete_snapshot(snapshot_id)
        except BenchError as exc:
            self.results.note(row, f"deleting the snapshot failed: {exc}")

    async def _route(self, rows: list[str], what: str, method: str, path: str) -> bool:
        """False (and the rows missing) when the server has no such route."""
        ok, why = await self.api.has_route(method, path)
        if not ok:
            self.results.missing(rows, f"{what}: not available on this server ({why})")
        return ok

    # -- rows ---------------------------------------------------------------------------------

    async def warmup(self) -> None:
        """One untimed create + exec + kill: page cache, the server's first-use paths."""
        self.progress.step("warm-up", 1)
        try:
            sbx, _, _ = await self.create_and_exec()
        except BenchError as exc:
            self.progress.log(f"warm-up failed: {exc}")
            return
        finally:
            self.progress.advance()
        await self._quiet_kill([sbx])

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
        rows = [
            "exec_roundtrip",
            "spawn_in_sandbox",
            "file_write_1mib",
            "file_read_1mib",
            "pause",
            "resume",
            "snapshot",
        ]
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

    async def concurrent_rows(self) -> None:
        for n, rounds in (
            (10, self.plan.concurrent_10_rounds),
            (50, self.plan.concurrent_50_rounds),
        ):
            row = f"concurrent_create_{n}"
            measure_idle = n == 10 and (
                self.want("idle_sandbox_rss_mib") or self.want("idle_sandbox_pss_mib")
            )
            if not self.want(row) and not measure_idle:
                continue
            self.progress.step(row, rounds * n)
            for r in range(rounds):
                await self._concurrent_round(row, n, idle=measure_idle and r == 0)

    async def _concurrent_round(self, row: str, n: int, *, idle: bool) -> None:
        async def one() -> tuple[Sbx, float, dict[str, float]]:
            try:
                return await self.create_and_exec(memory_mb=CONCURRENT_MEMORY_MB)
            finally:
                self.progress.advance()

        got = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
        made: list[Sbx] = []
        failed: list[BaseException] = []
        for g in got:
            if isinstance(g, BaseException):
                failed.append(g)
                continue
            sbx, total, stages = g
            made.append(sbx)
            self.results.add(row, total, stages)
        if failed:
            self.results.note(row, f"{len(failed)} of {n} failed: {failed[0]}")
        # A create that failed after the server made the sandbox: sweep by metadata.
        if idle and not made:
            self.results.missing(
                ["idle_sandbox_rss_mib", "idle_sandbox_pss_mib"],
                f"skipped: no sandbox of {row} started",
            )
        try:
            if idle and made:
                await self._idle_memory(made)
        finally:
            leftovers = set(await self._safe_list()) - {s.sandbox_id for s in made}
            await self._quiet_kill([*made, *leftovers])

    async def _safe_list(self) -> list[str]:
        try:
            return await self.api.list_ids()
        except Exception:
            return []

    async def _idle_memory(self, sandboxes: list[Sbx]) -> None:
        rows = ["idle_sandbox_rss_mib", "idle_sandbox_pss_mib"]
        if not self.local:
            self.results.missing(rows, "the server is not on this host")
            return
        self.progress.log(f"idle memory: waiting {self.plan.idle_wait:g}s")
        await asyncio.sleep(self.plan.idle_wait)
        found = await asyncio.to_thread(hostproc.scan, [s.sandbox_id for s in sandboxes])
        measured = 0
        for procs in found.values():
            if not procs:
                continue
            measured += 1
            self.results.add("idle_sandbox_rss_mib", hostproc.rss_mib(procs.main))
            self.results.add("idle_sandbox_pss_mib", hostproc.pss_mib(procs.main + procs.stubs))
        if not measured:
            self.results.missing(rows, "no runsc-sandbox/gofer process found for the sandboxes")

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
