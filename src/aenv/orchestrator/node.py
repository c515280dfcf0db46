"""The node's life: start-up (recovering what the catalog and the runtime still hold),
the timers (sandbox timeouts, hibernation of idle frozen sandboxes) and shutdown."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..background import Periodic
from ..domain import SandboxRecord, SandboxState
from ..errors import AenvError
from ..logctx import sandbox_context
from ..runtime.base import Runtime
from . import eventrecords as ev
from .context import NodeContext
from .envd_pool import EnvdPool
from .liveness import Liveness
from .pausing import Pauser
from .pool import WarmPool
from .recovery import Recovery
from .sandboxes import Sandboxes
from .table import SandboxTable
from .templates import TemplateRegistry

log = logging.getLogger("aenv.orchestrator")

TICK_SECONDS = 1.0
# Looking for sandboxes that died costs a /proc read each: every few ticks is soon enough.
LIVENESS_EVERY_TICKS = 3


@dataclass
class Node:
    ctx: NodeContext
    table: SandboxTable
    runtime: Runtime
    templates: TemplateRegistry
    sandboxes: Sandboxes
    pauser: Pauser
    pool: WarmPool
    envd: EnvdPool
    liveness: Liveness
    recovery: Recovery
    _timer: Periodic = field(init=False)
    _ticks: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._timer = Periodic("timers", TICK_SECONDS, self.tick, log)

    async def start(self, *, timers: bool = True) -> None:
        await self.recover()
        await self.templates.start()
        if timers:
            self._timer.start()
        self.pool.refill()

    async def recover(self) -> None:
        """Makes the catalog and the runtime agree after a restart or a crash."""
        await self.recovery.run()

    async def close(self) -> None:
        self.ctx.closing = True
        await self.pool.close()
        await self._timer.stop()
        await self.pauser.hibernate_all()
        await self.ctx.join()
        await self.templates.close()
        await self.runtime.close()
        await self.envd.close()

    async def tick(self) -> None:
        """One round of the timers at the context's clock."""
        now = self.ctx.now()
        for r in self.table.all():
            if r.end_at > now or not (r.state is SandboxState.RUNNING or r.in_standby_on_disk):
                continue
            with sandbox_context(r.sandbox_id):
                await self._expire(r)
        await self.pauser.hibernate_idle()
        self._ticks += 1
        if self._ticks % LIVENESS_EVERY_TICKS == 0:
            await self.liveness.sweep()

    async def _expire(self, r: SandboxRecord) -> None:
        try:
            if r.auto_pause:
                log.info("sandbox %s timed out: pausing", r.sandbox_id)
                await self.pauser.auto_pause(r.sandbox_id, r.auto_pause_memory)
            else:
                log.info("sandbox %s timed out: killing", r.sandbox_id)
                await self.sandboxes.end(r.sandbox_id, ev.KILL_TIMEOUT)
        except AenvError as e:
            log.info("timeout handling of %s: %s", r.sandbox_id, e.message)
        except Exception:
            log.exception("timeout handling of %s failed", r.sandbox_id)
