"""What the rows measured through a server's HTTP API share: the sample loop, polling, and
`RowsBase` (creating, killing and releasing sandboxes). The rows themselves are in
`scenarios_lifecycle.py` (one sandbox's operations) and `scenarios_scale.py` (many sandboxes
at once); `scenarios.ServerRows` has both. See bench/README.md for each row's definition.

Every row is robust to a server that lacks the operation (`Missing`: the row is recorded as
missing with the server's answer, the rest goes on) and to failed samples (noted, skipped).
Sandboxes are removed by id as soon as a row is done; `Api.cleanup` removes the rest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from . import hostproc
from .client import Abort, Api, BenchError, Missing, Sbx
from .cpu import CpuMeter
from .idle_cpu import busy_millicores
from .plan import Plan, Progress
from .stats import Results

SETTLE_TIMEOUT = 20.0
# A sandbox id no server has: asking about it tells whether a route exists, harmlessly.
PROBE_ID = "aenv-bench-no-such-sandbox"
# Seconds between two warm-pool creates: the pool (2 by default) refills in the meantime.
POOL_REFILL_WAIT = 1.5
# The machine's busy CPU (millicores) below which `settle` calls it quiet: an idle node with
# a few idle sandboxes is well under it, a publish or a boot well over.
QUIET_MC = 200.0

SampleFn = Callable[[int], Awaitable[tuple[float, dict[str, float]] | None]]


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


class RowsBase:
    """The rows of one server, their shared parts. `local`: the server runs on this host
    (its runsc processes can be found, for memory and to know when a killed or hibernated
    sandbox is gone). `home`: its AENV_HOME when the bench started it (host-side reads of its
    catalog and images), else None. `meter`: the server's process and its sandboxes' cgroups,
    when the bench started the server."""

    def __init__(
        self,
        api: Api,
        results: Results,
        plan: Plan,
        progress: Progress,
        *,
        want: Callable[[str], bool],
        local: bool = True,
        home: Path | None = None,
        meter: CpuMeter | None = None,
    ) -> None:
        self.api = api
        self.results = results
        self.plan = plan
        self.progress = progress
        self.want = want
        self.local = local
        self.home = home
        self.meter = meter
        self._troubled = False  # a row failed since the last `_release`
        self._bg: set[asyncio.Task[None]] = set()

    # -- helpers ------------------------------------------------------------------------------

    async def settle(self, below_mc: float = QUIET_MC, within: float = 30.0) -> None:
        """Waits (untimed) until the machine is quiet again: what a row's own set-up left
        running in the background (a snapshot's publish to the repository, a pool refill)
        is not charged to the next sample. Only for a server on this host."""
        if not self.local:
            return
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if await busy_millicores(0.5) < below_mc:
                return

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

    async def kill(self, sandboxes: Iterable[Sbx | str], *, at_once: int = 0) -> None:
        """Kills (`at_once` at a time, 0: all), then waits until their host processes are
        gone (so the next sample does not share the CPU with a teardown)."""
        ids = [s.sandbox_id if isinstance(s, Sbx) else s for s in sandboxes]
        if not ids:
            return
        pids: list[int] = []
        if self.local:
            found = await asyncio.to_thread(hostproc.scan, ids)
            pids = [p for procs in found.values() for p in procs.main]
        sem = asyncio.Semaphore(at_once or len(ids))

        async def one(sid: str) -> None:
            async with sem:
                await self.api.kill(sid)

        results = await asyncio.gather(*(one(i) for i in ids), return_exceptions=True)
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

    async def _quiet_kill(self, sandboxes: Iterable[Sbx | str], *, at_once: int = 0) -> None:
        try:
            await self.kill(sandboxes, at_once=at_once)
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

    async def _safe_list(self) -> list[str]:
        try:
            return await self.api.list_ids()
        except Exception:
            return []
