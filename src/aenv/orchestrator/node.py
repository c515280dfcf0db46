"""The node's life: start-up (recovering what the catalog and the runtime still hold),
the timers (sandbox timeouts, hibernation of idle frozen sandboxes) and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from ..domain import PauseTier, SandboxRecord, SandboxState
from ..errors import AenvError
from ..runtime.base import Runtime
from .context import NodeContext
from .envd_client import EnvdClient
from .liveness import Liveness
from .pausing import Pauser
from .pool import WarmPool
from .sandboxes import Sandboxes
from .table import SandboxTable
from .templates import TemplateRegistry

log = logging.getLogger("aenv.orchestrator")

TICK_SECONDS = 1.0
# Looking for sandboxes that died costs a /proc read each: every few ticks is soon enough.
LIVENESS_EVERY_TICKS = 3
_ON_DISK = (PauseTier.HIBERNATED, PauseTier.FILES)


@dataclass
class Node:
    ctx: NodeContext
    table: SandboxTable
    runtime: Runtime
    templates: TemplateRegistry
    sandboxes: Sandboxes
    pauser: Pauser
    pool: WarmPool
    envd: EnvdClient
    liveness: Liveness
    _timer: asyncio.Task[None] | None = field(default=None, init=False)
    _ticks: int = field(default=0, init=False)

    async def start(self, *, timers: bool = True) -> None:
        await self.recover()
        await self.templates.start()
        if timers:
            self._timer = asyncio.create_task(self._timer_loop(), name="aenv-timers")
        self.pool.refill()

    async def recover(self) -> None:
        """Running and frozen sandboxes whose containers survived come back as they were;
        hibernated and files-only ones need nothing running; any other is lost."""
        records = await self.table.stored()
        live = (SandboxState.RUNNING, SandboxState.PAUSED)
        keep = {r.instance.id for r in records if r.instance and r.state in live}
        recovered = await self.runtime.start(keep)
        for r in records:
            if r.state is SandboxState.KILLED:
                await self.table.delete(r)
                continue
            if r.instance and r.instance.id in recovered:
                r.instance = recovered[r.instance.id]
                if r.state not in live:
                    r.state = SandboxState.RUNNING
                await self._reapply_egress(r)
                log.info("recovered sandbox %s (%s)", r.sandbox_id, r.state)
            elif r.tier in _ON_DISK:
                r.instance = None  # durable on disk; nothing was running
            elif r.state is not SandboxState.LOST:
                r.state = SandboxState.LOST
                r.instance = None
                r.note = "it was running when the server stopped and could not be recovered"
                log.warning("sandbox %s lost across the restart", r.sandbox_id)
            self.table.add(r)
            await self.table.save(r)

    async def _reapply_egress(self, r: SandboxRecord) -> None:
        """The slot kept its rules, but not what the server itself serves for them (the
        egress proxy of domain rules): put the record's policy in force again."""
        if not r.egress.has_domains or r.instance is None:
            return
        try:
            await self.runtime.set_egress(r.instance, r.egress)
        except Exception as e:
            # Fail closed: the slot's own rules still send 80/443 to a proxy not there.
            log.warning("egress rules of recovered sandbox %s: %s", r.sandbox_id, e)

    async def close(self) -> None:
        self.ctx.closing = True
        await self.pool.close()
        if self._timer:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
        await self.pauser.hibernate_all()
        await self.ctx.join()
        await self.templates.close()
        await self.runtime.close()
        await self.envd.close()

    async def _timer_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            try:
                await self.tick()
            except Exception:
                log.exception("timer loop")

    async def tick(self) -> None:
        """One round of the timers at the context's clock."""
        now = self.ctx.now()
        for r in self.table.all():
            if r.end_at > now or r.state is not SandboxState.RUNNING:
                continue
            try:
                if r.auto_pause:
                    log.info("sandbox %s timed out: pausing", r.sandbox_id)
                    await self.pauser.pause(r.sandbox_id, memory=r.auto_pause_memory)
                else:
                    log.info("sandbox %s timed out: killing", r.sandbox_id)
                    await self.sandboxes.kill(r.sandbox_id)
            except AenvError as e:
                log.info("timeout handling of %s: %s", r.sandbox_id, e.message)
            except Exception:
                log.exception("timeout handling of %s failed", r.sandbox_id)
        for sandbox_id in self.pauser.idle_frozen():
            try:
                await self.pauser.hibernate(sandbox_id)
            except Exception:
                log.exception("hibernating %s failed", sandbox_id)
        self._ticks += 1
        if self._ticks % LIVENESS_EVERY_TICKS == 0:
            await self.liveness.sweep()
