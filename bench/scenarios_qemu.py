"""The QEMU backend's rows (`AENV_RUNTIME=qemu`), on a server of its own: the core lifecycle
through the same API as the gVisor rows, and what an idle microVM costs the host. On a host
whose KVM cannot boot a standard guest (these machines: PVM) QEMU emulates the guest's CPU
(TCG), and every row says so in its title: a KVM host's figures differ by the guest's code
running at native speed."""

from __future__ import annotations

import asyncio
import time

from .client import BenchError, Sbx
from .scenarios import ServerRows

QEMU_ROWS = [
    "qemu_create_to_first_exec",
    "qemu_exec_roundtrip",
    "qemu_pause",
    "qemu_resume",
    "qemu_snapshot",
    "qemu_fork_1",
    "qemu_idle_sandbox_mc",
]
QEMU_ENV = {"AENV_RUNTIME": "qemu"}


class QemuRows(ServerRows):
    async def qemu_rows(self) -> None:
        if not any(self.want(r) for r in QEMU_ROWS):
            return
        p = self.plan
        if self.want("qemu_create_to_first_exec"):
            self.progress.step("qemu_create_to_first_exec", p.qemu)

            async def create(_i: int) -> tuple[float, dict[str, float]]:
                sbx, total, stages = await self.create_and_exec()
                await self._quiet_kill([sbx])
                return total, stages

            await self.loop(["qemu_create_to_first_exec"], p.qemu, create)
        try:
            sbx, _, _ = await self.create_and_exec()
        except BenchError as exc:
            rest = [r for r in QEMU_ROWS[1:] if self.want(r)]
            self.results.missing(rest, f"could not create a sandbox: {exc}")
            return
        try:
            await self._on_one(sbx)
        finally:
            await self._release([sbx])
        if self.want("qemu_idle_sandbox_mc"):
            await self._idle()

    async def _on_one(self, sbx: Sbx) -> None:
        p = self.plan
        if self.want("qemu_exec_roundtrip"):
            self.progress.step("qemu_exec_roundtrip", p.qemu * 2)

            async def run(_i: int) -> tuple[float, dict[str, float]]:
                t = await self.api.run(sbx)
                return t.ms, t.stages

            await self.loop(["qemu_exec_roundtrip"], p.qemu * 2, run)
        if self.want("qemu_pause") or self.want("qemu_resume"):
            self.progress.step("qemu_pause/resume", p.qemu)

            async def pause_resume(_i: int) -> None:
                paused = await self.api.pause(sbx.sandbox_id)
                self.results.add("qemu_pause", paused.ms, paused.stages)
                resumed = await self.api.resume(sbx.sandbox_id)
                self.results.add("qemu_resume", resumed.ms, resumed.stages)

            await self.loop(["qemu_pause", "qemu_resume"], p.qemu, pause_resume)
        if self.want("qemu_snapshot"):
            self.progress.step("qemu_snapshot", p.qemu)

            async def snap(_i: int) -> tuple[float, dict[str, float]]:
                await self.settle()
                sid, t = await self.api.snapshot(sbx.sandbox_id)
                await self._delete_snapshot("qemu_snapshot", sid)
                return t.ms, t.stages

            await self.loop(["qemu_snapshot"], p.qemu, snap)
        if self.want("qemu_fork_1"):
            self.progress.step("qemu_fork_1", p.qemu)

            async def fork(_i: int) -> tuple[float, dict[str, float]]:
                await self.settle()
                return await self._fork_once(sbx, 1)

            await self.loop(["qemu_fork_1"], p.qemu, fork)

    async def _idle(self) -> None:
        """The node's own CPU (server + the VMs' cgroups) per idle VM, over a window."""
        p, row = self.plan, "qemu_idle_sandbox_mc"
        if self.meter is None:
            self.results.missing([row], "needs a server the bench started (its CPU meter)")
            return
        self.progress.step(row, 1)
        made: list[Sbx] = []
        try:
            for _ in range(p.qemu_idle):
                sbx, _, _ = await self.create_and_exec()
                made.append(sbx)
            await asyncio.sleep(p.idle_cpu_settle)
            a = self.meter.sample()
            t0 = time.monotonic()
            await asyncio.sleep(p.qemu_idle_window)
            b = self.meter.sample()
            split = self.meter.split(a, b)
            seconds = time.monotonic() - t0
            mc = (split.server_s + split.sandboxes_s) / seconds * 1000 / len(made)
            self.results.add(row, mc, {"sandboxes": len(made), "window_s": seconds})
            self.results.note(row, f"{len(made)} idle VMs; machine busy {split.total_s:.2f} s")
        except BenchError as exc:
            self.results.missing([row], f"failed: {exc}")
        finally:
            self.progress.advance()
            await self._release(made)
