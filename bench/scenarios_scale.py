"""The rows of many sandboxes at once, measured through a server's HTTP API: concurrent
creates and execs (the scale curve), idle memory, and a populated node (list_1000,
create/exec with ~100 sandboxes on the node). See bench/README.md for each row."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from . import hostproc
from .client import BenchError, Sbx
from .cpu import CpuMeter
from .idle_cpu import busy_millicores
from .scenarios_common import POOL_REFILL_WAIT, RowsBase, sample_loop

CONCURRENT_MEMORY_MB = 256
# The idle sandboxes filling the node (the smallest size the API takes: the node's memory
# budget, 90% of RAM unless AENV_MAX_MEMORY_MB says otherwise, counts memoryMB).
FILLER_MEMORY_MB = 128
CREATE_WITH = "create_to_first_exec_with_100"
EXEC_WITH = "exec_roundtrip_with_100"
LIST_ROW = "list_1000"
IDLE_NODE = "idle_node_mc"
IDLE_SANDBOX = "idle_sandbox_mc"
# A fill stops after this many failed creates (the node is full, or failing).
FILL_FAILURES = 5


@dataclass(frozen=True)
class IdleCpu:
    """Millicores over the idle window: the whole machine's, and the node's own (None when
    the bench did not start the server)."""

    machine_mc: float
    node_mc: float | None


class ScaleRows(RowsBase):
    """concurrent creates and execs, idle memory, a populated node."""

    async def concurrent_rows(self) -> None:
        """concurrent_create_N (N create + first exec at once), then on the first round's
        sandboxes: idle memory (N = 10) and exec_concurrent_N (each runs a command at once)."""
        for n, rounds in (
            (10, self.plan.concurrent_10_rounds),
            (50, self.plan.concurrent_50_rounds),
        ):
            row = f"concurrent_create_{n}"
            exec_row = f"exec_concurrent_{n}"
            measure_idle = n == 10 and (
                self.want("idle_sandbox_rss_mib") or self.want("idle_sandbox_pss_mib")
            )
            measure_exec = self.want(exec_row)
            if not self.want(row) and not measure_idle and not measure_exec:
                continue
            self.progress.step(row, rounds * n)
            for r in range(max(1, rounds)):
                await self._concurrent_round(
                    row,
                    n,
                    idle=measure_idle and r == 0,
                    exec_row=exec_row if measure_exec and r == 0 else None,
                )

    async def _concurrent_round(
        self, row: str, n: int, *, idle: bool, exec_row: str | None = None
    ) -> None:
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
        if exec_row and not made:
            self.results.missing([exec_row], f"skipped: no sandbox of {row} started")
        try:
            if idle and made:
                await self._idle_memory(made)
            if exec_row and made:
                await self._exec_concurrent(exec_row, made)
        finally:
            leftovers = set(await self._safe_list()) - {s.sandbox_id for s in made}
            await self._quiet_kill([*made, *leftovers])

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

    async def _exec_concurrent(self, row: str, sandboxes: list[Sbx]) -> None:
        """One untimed round (every sandbox runs a command at once), then
        `exec_concurrent_rounds` timed ones; each sandbox's exec is one sample."""
        n = len(sandboxes)
        rounds = self.plan.exec_concurrent_rounds
        self.progress.step(row, rounds * n)
        await asyncio.gather(*(self.api.run(s) for s in sandboxes), return_exceptions=True)
        failed: list[BaseException] = []
        for _ in range(rounds):
            got = await asyncio.gather(
                *(self.api.run(s) for s in sandboxes), return_exceptions=True
            )
            for g in got:
                if isinstance(g, BaseException):
                    failed.append(g)
                else:
                    self.results.add(row, g.ms, g.stages)
            self.progress.advance(n)
        if failed:
            self.results.note(row, f"{len(failed)} of {rounds * n} failed: {failed[0]}")
        if n != int(row.rsplit("_", 1)[1]):
            self.results.note(row, f"{n} sandboxes (the others did not start)")

    # -- a populated node -----------------------------------------------------------------------

    async def populated_rows(self) -> None:
        """create_to_first_exec_with_100 and exec_roundtrip_with_100 (with one sandbox on the
        node: the baseline; then with `idle_sandboxes` idle ones), then list_1000 (with
        `list_sandboxes` on the node, files-only paused: they hold no memory)."""
        want_with = [r for r in (CREATE_WITH, EXEC_WITH) if self.want(r)]
        want_list = self.want(LIST_ROW)
        want_idle = [r for r in (IDLE_NODE, IDLE_SANDBOX) if self.want(r)]
        if want_idle and not self.local:
            self.results.missing(want_idle, "the server is not on this host")
            want_idle = []
        if not want_with and not want_list and not want_idle:
            return
        filler: list[str] = []
        try:
            if want_list:
                await self._list_samples(baseline=True, on_node=len(await self._listed()))
            if want_with or want_idle:
                await self._with_rows(filler, idle_cpu=bool(want_idle))
            if want_list:
                await self._list_row(filler)
        finally:
            self.progress.step(f"kill {len(filler)} sandboxes", 1)
            await self._quiet_kill(filler, at_once=16)
            self.progress.advance()

    async def _listed(self) -> list[object]:
        try:
            return list((await self.api.list_timed()).data)
        except BenchError:
            return []

    async def _idle_cpu(self, label: str) -> IdleCpu:
        p = self.plan
        self.progress.step(f"{label}: settle {p.idle_cpu_settle:g}s, {p.idle_cpu_window:g}s", 1)
        await asyncio.sleep(p.idle_cpu_settle)
        if self.meter is None:
            got = IdleCpu(await busy_millicores(p.idle_cpu_window), None)
        else:
            a = self.meter.sample()
            await asyncio.sleep(p.idle_cpu_window)
            cpu = CpuMeter.split(a, self.meter.sample())
            per_s = 1000 / p.idle_cpu_window
            got = IdleCpu(cpu.total_s * per_s, (cpu.server_s + cpu.sandboxes_s) * per_s)
        self.progress.advance()
        return got

    async def _with_rows(self, filler: list[str], *, idle_cpu: bool = False) -> None:
        p = self.plan
        rows = [CREATE_WITH, EXEC_WITH]
        empty = await self._idle_cpu("machine busy CPU, no sandboxes") if idle_cpu else None
        try:
            ref, _, _ = await self.create_and_exec()
        except BenchError as exc:
            self.results.missing(rows, f"could not create a sandbox: {exc}")
            return
        try:
            await self._with_samples(ref, baseline=True)
            made = await self._fill(p.idle_sandboxes - 1, filler, files_only=False)
            if empty is not None:
                full = await self._idle_cpu(f"machine busy CPU, {made + 1} idle sandboxes")
                self._idle_cpu_rows(empty, full, made + 1)
            self.progress.log(f"populated: {made} idle sandboxes; settling {p.idle_wait:g}s")
            await asyncio.sleep(p.idle_wait)
            await self._with_samples(ref, baseline=False)
            for row in rows:
                self.results.note(
                    row,
                    f"with {made + 1} sandboxes on the node ({made} idle, memoryMB "
                    f"{FILLER_MEMORY_MB}, + the measured one); baseline: the same with only "
                    "the measured one, just before",
                )
        finally:
            await self._quiet_kill([ref])

    def _idle_cpu_rows(self, empty: IdleCpu, full: IdleCpu, n: int) -> None:
        window = f"over {self.plan.idle_cpu_window:g} s"
        machine = (
            f"the machine's busy CPU (/proc/stat, the host's own agents too): "
            f"{empty.machine_mc:.1f} mc with none, {full.machine_mc:.1f} mc with {n}"
        )
        if empty.node_mc is None or full.node_mc is None:
            node_empty, node_full = empty.machine_mc, full.machine_mc
            what = f"{machine} (the server is not the bench's: its own CPU is not measured)"
        else:
            node_empty, node_full = empty.node_mc, full.node_mc
            what = (
                "the node's own CPU: the server process and its sandboxes' cgroups "
                f"(runsc and what runs inside); {machine}"
            )
        self.results.add(IDLE_NODE, node_empty)
        self.results.note(
            IDLE_NODE, f"{window}, the server up with its warm pool and no other sandbox; {what}"
        )
        self.results.add(IDLE_SANDBOX, max(0.0, node_full - node_empty) / n)
        self.results.note(
            IDLE_SANDBOX,
            f"({node_full:.1f} - {node_empty:.1f}) / {n} {window}: with {n} idle sandboxes "
            f"(memoryMB {FILLER_MEMORY_MB}, settled {self.plan.idle_cpu_settle:g} s) less the "
            "same with none, per sandbox",
        )

    async def _with_samples(self, ref: Sbx, *, baseline: bool) -> None:
        """exec on `ref` and create → first exec (warm pool, killed each time), into the
        rows (`baseline`: the node holds only `ref`)."""
        p = self.plan
        side = "with one" if baseline else "populated"
        if self.want(EXEC_WITH):
            self.progress.step(f"{EXEC_WITH} ({side})", p.populated_exec)
            for _ in range(2):
                await self.api.run(ref)

            async def run(_i: int) -> tuple[float, dict[str, float]]:
                t = await self.api.run(ref)
                return t.ms, t.stages

            await self._loop_side([EXEC_WITH], p.populated_exec, run, baseline)
        if self.want(CREATE_WITH):
            self.progress.step(f"{CREATE_WITH} ({side})", p.populated_create)

            async def create(_i: int) -> tuple[float, dict[str, float]]:
                await asyncio.sleep(POOL_REFILL_WAIT)
                sbx, total, stages = await self.create_and_exec()
                await self.kill([sbx])
                return total, stages

            await self._loop_side([CREATE_WITH], p.populated_create, create, baseline)

    async def _loop_side(
        self,
        rows: list[str],
        n: int,
        fn: Callable[[int], Awaitable[tuple[float, dict[str, float]] | None]],
        baseline: bool,
    ) -> None:
        if not baseline:
            await self.loop(rows, n, fn)
            return
        await sample_loop(
            self.results,
            rows,
            n,
            fn,
            self.progress,
            baseline=True,
            max_failures=self.plan.max_failures,
        )

    async def _fill(self, count: int, into: list[str], *, files_only: bool) -> int:
        """Creates `count` sandboxes (`populate_concurrency` at once; `files_only`: each is
        then paused with `memory: false`) and appends their ids to `into`. Stops after
        FILL_FAILURES failed creates; returns how many were made."""
        if count <= 0:
            return 0
        self.progress.step(
            f"fill the node: {count} {'paused (files only)' if files_only else 'idle'}", count
        )
        sem = asyncio.Semaphore(self.plan.populate_concurrency)
        made = 0
        errors: list[str] = []

        async def one() -> None:
            nonlocal made
            async with sem:
                if len(errors) >= FILL_FAILURES:
                    return
                try:
                    sbx, _ = await self.api.create(memory_mb=FILLER_MEMORY_MB)
                    into.append(sbx.sandbox_id)
                    if files_only:
                        await self.api.pause(sbx.sandbox_id, memory=False)
                    made += 1
                except BenchError as exc:
                    errors.append(str(exc))
                finally:
                    self.progress.advance()

        await asyncio.gather(*(one() for _ in range(count)))
        if errors:
            self.progress.log(f"fill: {len(errors)} failed, first: {errors[0]}")
        return made

    async def _pause_files(self, ids: list[str]) -> int:
        """Pauses running sandboxes with `memory: false`; returns how many were."""
        if not ids:
            return 0
        self.progress.step(f"pause {len(ids)} (files only)", len(ids))
        sem = asyncio.Semaphore(self.plan.populate_concurrency)

        async def one(sid: str) -> bool:
            async with sem:
                try:
                    await self.api.pause(sid, memory=False)
                    return True
                except BenchError:
                    return False
                finally:
                    self.progress.advance()

        return sum(await asyncio.gather(*(one(s) for s in ids)))

    async def _list_row(self, filler: list[str]) -> None:
        p = self.plan
        paused = await self._pause_files(list(filler))
        await self._fill(p.list_sandboxes - len(filler), filler, files_only=True)
        on_node = len(await self._listed())
        if not on_node:
            self.results.missing([LIST_ROW], "the list answered nothing")
            return
        await self._list_samples(baseline=False, on_node=on_node)
        short = " (quick mode: fewer)" if on_node < 1000 else ""
        self.results.note(
            LIST_ROW,
            f"{on_node} sandboxes listed{short}, {len(filler)} of them made here and paused "
            f"files-only ({paused} were the idle ones); GET /v2/sandboxes?limit=1000 (one "
            "page); baseline: the same list before the node was filled",
        )

    async def _list_samples(self, *, baseline: bool, on_node: int) -> None:
        n = self.plan.list
        self.progress.step(f"{LIST_ROW} ({on_node} on the node)", n)
        for _ in range(2):
            await self.api.list_timed()

        async def one(_i: int) -> tuple[float, dict[str, float]]:
            t = await self.api.list_timed()
            return t.ms, t.stages

        await self._loop_side([LIST_ROW], n, one, baseline)
