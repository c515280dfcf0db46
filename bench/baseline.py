"""The baseline: the same operations done directly with the `runsc` CLI on this machine, in the
same run, on the raw sandboxes of raw_runsc.py (the same rootfs, the same sandbox shape, network
slots built like the server's, the same limits and runsc flags).

Times are wall-clock around each runsc CLI call (so they include the CLI's own start-up, as
in reference/gvisor.md). A slot is built before the clock starts, except in the `_cold` row.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time

from aenv.errors import AenvError
from aenv.runtime import rootfs
from aenv.runtime.net.network import Slot

from . import hostproc
from .client import BenchError
from .raw_runsc import CONCURRENT_MEMORY_MB, Ctr, RunscSandboxes, elapsed_ms
from .scenarios_common import SampleFn, sample_loop, wait_until
from .scenarios_lifecycle import DIRTY_MEMORY_MB, dirty_command


class RawRunsc(RunscSandboxes):
    """Runs the baseline rows; `close()` removes every container, slot, cgroup and file."""

    async def loop(self, rows: list[str], n: int, fn: SampleFn) -> bool:
        return await sample_loop(
            self.results,
            rows,
            n,
            fn,
            self.progress,
            baseline=True,
            max_failures=self.plan.max_failures,
        )

    def wants(self, row: str) -> bool:
        return self.want(row) and row not in self.skip

    # -- rows ---------------------------------------------------------------------------------

    async def run_all(self) -> None:
        p = self.plan
        if not p.baseline_heavy:
            heavy = ["snapshot_dirty_1gib", "fork_1", "fork_4", "fork_16", "concurrent_create_50"]
            self.results.missing(
                [r for r in heavy if self.want(r)], "not run in quick mode", baseline=True
            )
            self.skip.update(heavy)
        await self._warmup()
        if self.wants("create_to_first_exec"):
            await self._create_row("create_to_first_exec", p.create, cold=False)
        if self.wants("create_to_first_exec_cold"):
            await self._create_row("create_to_first_exec_cold", p.create_cold, cold=True)
        await self._running_rows()
        if self.wants("hibernate") or self.wants("resume_from_disk"):
            await self._hibernate_rows()
        if self.wants("snapshot_dirty_1gib"):
            await self._dirty_row()
        for n, count in ((1, p.fork_1), (4, p.fork_4), (16, p.fork_16)):
            if self.wants(f"fork_{n}"):
                await self._fork_row(n, count)
        await self._concurrent_rows()

    async def _warmup(self) -> None:
        self.progress.step("baseline warm-up", 1)
        try:
            ctr = await self.fresh()
            await self.destroy(ctr)
        finally:
            self.progress.advance()

    async def _create_row(self, row: str, n: int, *, cold: bool) -> None:
        self.progress.step(f"baseline {row}", n)

        async def one(_i: int) -> tuple[float, dict[str, float]]:
            stages: dict[str, float] = {}
            if cold:
                t0 = time.perf_counter()
                slot = await self.slot()
                stages["netns"] = elapsed_ms(t0)
            else:
                slot = await self.slot()
                t0 = time.perf_counter()
            ctr, stages["run"] = await self.launch(slot)
            try:
                stages["exec"] = await self.exec(ctr)
                total = elapsed_ms(t0)
            finally:
                await self.destroy(ctr)
            return total, stages

        await self.loop([row], n, one)

    async def _running_rows(self) -> None:
        rows = ["exec_roundtrip", "pause", "resume", "snapshot"]
        if not any(self.wants(r) for r in rows):
            return
        p = self.plan
        ctr = await self.fresh()
        try:
            if self.wants("exec_roundtrip"):
                self.progress.step("baseline exec_roundtrip", p.exec)
                await self.exec(ctr)

                async def run(_i: int) -> tuple[float, dict[str, float]]:
                    return await self.exec(ctr), {}

                await self.loop(["exec_roundtrip"], p.exec, run)
            if self.wants("pause") or self.wants("resume"):
                self.progress.step("baseline pause/resume", p.pause)

                async def pause(_i: int) -> None:
                    paused = await self._op("pause", lambda: self.runsc.pause(ctr.cid))
                    self.results.add("pause", paused, baseline=True)
                    resumed = await self._op("resume", lambda: self.runsc.resume(ctr.cid))
                    self.results.add("resume", resumed, baseline=True)
                    await self.exec(ctr)

                await self.loop(["pause", "resume"], p.pause, pause)
            if self.wants("snapshot"):
                self.progress.step("baseline snapshot", p.snapshot)

                async def snap(_i: int) -> tuple[float, dict[str, float]]:
                    image = await asyncio.to_thread(self.image)
                    try:
                        ms = await self.checkpoint(ctr, image, leave_running=True)
                    finally:
                        await asyncio.to_thread(shutil.rmtree, image, True)
                    await self.exec(ctr)
                    return ms, {}

                await self.loop(["snapshot"], p.snapshot, snap)
        finally:
            await self.destroy(ctr)

    async def _hibernate_rows(self) -> None:
        """checkpoint (container stops) = hibernate; restore into a new container id, bundle
        and slot = resume_from_disk. The restored one is hibernated again next sample."""
        self.progress.step("baseline hibernate/resume_from_disk", self.plan.hibernate)
        state = {"ctr": await self.fresh()}

        async def one(_i: int) -> None:
            old = state["ctr"]
            image = await asyncio.to_thread(self.image)
            try:
                hibernated = await self.checkpoint(old, image, leave_running=False)
                self.results.add("hibernate", hibernated, baseline=True)
                await self.destroy(old)
                slot = await self.slot()
                # Its files, as the server's hibernated sandbox: the same upper.
                await wait_until(lambda: not rootfs.is_mount_point(old.mount), 10.0, 0.005)
                new, restored = await self.launch(slot, old.memory_mb, image=image, upper=old.upper)
                state["ctr"] = new
                self.results.add("resume_from_disk", restored, baseline=True)
                await self.exec(new)
            finally:
                await asyncio.to_thread(shutil.rmtree, image, True)

        try:
            await self.loop(["hibernate", "resume_from_disk"], self.plan.hibernate, one)
        finally:
            await self.destroy(state["ctr"])

    async def _dirty_row(self) -> None:
        row = "snapshot_dirty_1gib"
        self.progress.step(f"baseline {row}", self.plan.dirty)
        command = dirty_command(self.plan.dirty_mib)

        async def one(_i: int) -> tuple[float, dict[str, float]]:
            ctr = await self.fresh(DIRTY_MEMORY_MB)
            image = await asyncio.to_thread(self.image)
            try:
                wrote = await self.exec(ctr, command, time_limit=600)
                ms = await self.checkpoint(ctr, image, leave_running=True)
            finally:
                await self.destroy(ctr)
                await asyncio.to_thread(shutil.rmtree, image, True)
            return ms, {"write_in_sandbox": wrote}

        await self.loop([row], self.plan.dirty, one)

    async def _fork_row(self, n: int, count: int) -> None:
        """checkpoint --leave-running of the source, then N restores at once, each into its
        own new container, bundle and slot, and one exec in each: until every child answers."""
        row = f"fork_{n}"
        self.progress.step(f"baseline {row}", count)
        source = await self.fresh()

        async def one(_i: int) -> tuple[float, dict[str, float]]:
            slots = await self.slots(n)
            image = await asyncio.to_thread(self.image)
            children: list[Ctr] = []

            async def child(slot: Slot) -> None:
                # The source's files as they were (a restore reopens what was open, some of
                # it written since boot), as a fork's child gets them.
                upper = await asyncio.to_thread(self.copy_upper, source.upper)
                ctr, _ = await self.launch(slot, source.memory_mb, image=image, upper=upper)
                children.append(ctr)
                await self.exec(ctr)

            try:
                t0 = time.perf_counter()
                ckpt = await self.checkpoint(source, image, leave_running=True)
                got = await asyncio.gather(*(child(s) for s in slots), return_exceptions=True)
                total = elapsed_ms(t0)
            finally:
                made = {c.slot.index for c in children}
                for s in slots:
                    if s.index not in made:
                        with contextlib.suppress(AenvError):
                            await self.net.teardown(s.index)
                await self.destroy_all(children)
                await asyncio.to_thread(shutil.rmtree, image, True)
            bad = [g for g in got if isinstance(g, BaseException)]
            if bad:
                raise BenchError(f"{len(bad)}/{n} children failed: {bad[0]}")
            return total, {"checkpoint": ckpt}

        try:
            await self.loop([row], count, one)
        finally:
            await self.destroy(source)

    async def _concurrent_rows(self) -> None:
        p = self.plan
        for n, rounds in ((10, p.concurrent_10_rounds), (50, p.concurrent_50_rounds)):
            row = f"concurrent_create_{n}"
            idle = n == 10 and (
                self.wants("idle_sandbox_rss_mib") or self.wants("idle_sandbox_pss_mib")
            )
            if not self.wants(row) and not idle:
                continue
            self.progress.step(f"baseline {row}", rounds * n)
            for r in range(rounds):
                await self._concurrent_round(row, n, idle=idle and r == 0)

    async def _concurrent_round(self, row: str, n: int, *, idle: bool) -> None:
        slots = await self.slots(n)
        made: list[Ctr] = []

        async def one(slot: Slot) -> float:
            try:
                t0 = time.perf_counter()
                ctr, _ = await self.launch(slot, CONCURRENT_MEMORY_MB)
                made.append(ctr)
                await self.exec(ctr)
                return elapsed_ms(t0)
            finally:
                self.progress.advance()

        try:
            got = await asyncio.gather(*(one(s) for s in slots), return_exceptions=True)
            failed = [g for g in got if isinstance(g, BaseException)]
            for g in got:
                if not isinstance(g, BaseException):
                    self.results.add(row, g, baseline=True)
            if failed:
                self.results.note(row, f"{len(failed)} of {n} failed: {failed[0]}", baseline=True)
            if idle and made:
                await asyncio.sleep(self.plan.idle_wait)
                found = await asyncio.to_thread(hostproc.scan, [c.cid for c in made])
                for procs in found.values():
                    if procs:
                        self.results.add(
                            "idle_sandbox_rss_mib", hostproc.rss_mib(procs.main), baseline=True
                        )
                        self.results.add(
                            "idle_sandbox_pss_mib",
                            hostproc.pss_mib(procs.main + procs.stubs),
                            baseline=True,
                        )
        finally:
            made_slots = {c.slot.index for c in made}
            for s in slots:
                if s.index not in made_slots:
                    with contextlib.suppress(AenvError):
                        await self.net.teardown(s.index)
            await self.destroy_all(made)
