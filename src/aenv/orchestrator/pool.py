"""The warm pool: sandboxes of the default template booted ahead of demand (envd up and
warmed, not yet initialised), so a create that matches one only pays for envd's /init."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from dataclasses import dataclass, field, replace
from datetime import timedelta

from ..domain import (
    DEFAULT_TEMPLATE,
    CreateRequest,
    SandboxRecord,
    SandboxState,
    TemplateRecord,
    Timings,
)
from ..errors import AenvError
from .boot import Booter, envd_token, traffic_token
from .bootsnaps import BootSnapshots
from .context import NodeContext
from .idle import IdleTracker
from .table import SandboxTable
from .templates import TemplateRegistry

log = logging.getLogger("aenv.orchestrator")

# Seconds between handing out a pool sandbox and booting its replacement.
REFILL_DELAY = 0.75


@dataclass
class WarmPool:
    ctx: NodeContext
    table: SandboxTable
    booter: Booter
    templates: TemplateRegistry
    boot_snapshots: BootSnapshots
    idle: IdleTracker
    _warm: list[SandboxRecord] = field(default_factory=list, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)

    def take(self, tpl: TemplateRecord, cpu: int, mem: int) -> SandboxRecord | None:
        if tpl.has_memory:
            return None
        for i, w in enumerate(self._warm):
            if (w.template_id, w.cpu_count, w.memory_mb) == (tpl.template_id, cpu, mem) and (
                w.boot.from_layers == tpl.layers
            ):
                return self._warm.pop(i)
        return None

    async def adopt(
        self, w: SandboxRecord, req: CreateRequest, alias: str | None, timeout: int, t: Timings
    ) -> SandboxRecord | None:
        """Turns a pre-booted sandbox into the requested one: only envd's /init is left.
        None if that failed (the caller boots a new one)."""
        self.refill(delay=REFILL_DELAY)
        w.alias = alias
        w.metadata = dict(req.metadata)
        w.owner = req.owner
        w.standby_after = req.standby_after
        w.timeout = timeout
        w.env_vars = dict(req.env_vars)
        held, w.envd_access_token = w.envd_access_token, envd_token()
        w.auto_pause, w.auto_pause_memory = req.auto_pause, req.auto_pause_memory
        w.auto_resume, w.egress = req.auto_resume, replace(req.egress)
        w.traffic_access_token = traffic_token(req)
        w.mask_request_host = req.mask_request_host
        assert w.instance is not None
        await self.idle.wake(w.sandbox_id)
        try:
            if not w.egress.is_open:  # booted with none: in force before the user's first call
                with t.stage("egress"):
                    await self.booter.apply_egress(w)
            with t.stage("pool-init"):
                await self.booter.init_envd(w, current_token=held or None)
        except Exception:
            log.exception("a pre-booted sandbox could not be initialised; booting a new one")
            self.table.discard(w.sandbox_id)
            await self.booter.destroy_quietly(w.instance)
            await self.booter.forget(w)
            return None
        w.state = SandboxState.RUNNING
        w.started_at = self.ctx.now()
        w.end_at = w.started_at + timedelta(seconds=timeout)
        await self.table.save(w)
        return w

    def refill(self, delay: float = 0.0) -> None:
        if self.ctx.closing:
            return  # (with a pool size of 0 the task still makes the boot snapshot)
        if self._task is None or self._task.done():
            # A context of its own: the create that triggered a refill is not what the
            # refill's log lines are about.
            self._task = asyncio.create_task(
                self._fill(delay), name="aenv-warm", context=contextvars.Context()
            )

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for w in self._warm:
            self.table.discard(w.sandbox_id)
            if w.instance:
                await self.booter.destroy_quietly(w.instance)
            await self.booter.forget(w)
        self._warm.clear()

    async def _fill(self, delay: float) -> None:
        # After a pool sandbox was handed out, its first commands usually follow at once:
        # the refill (a restore, CPU-bound) waits instead of competing with them.
        await asyncio.sleep(delay)
        await self._fill_pool()
        # After the first fill, so a node that just started has its pool ready soonest.
        await self.boot_snapshots.prepare()
        await self._fill_pool()

    async def _fill_pool(self) -> None:
        s = self.ctx.settings
        while len(self._warm) < s.sandbox_pool_size and not self.ctx.closing:
            tpl = await self.templates.find(DEFAULT_TEMPLATE)
            if tpl is None:
                return
            cpu = tpl.cpu_count or s.default_cpu_count
            mem = tpl.memory_mb or s.default_memory_mb
            try:
                self.table.reserve(mem)
            except AenvError:
                return
            boot = self.boot_snapshots.for_shape(tpl, cpu, mem)
            alias = tpl.names[0] if tpl.names else None
            try:
                r = await self.booter.preboot(tpl, cpu, mem, alias=alias, boot=boot)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("pre-booting a sandbox failed")
                await asyncio.sleep(5)
                continue
            self._warm.append(r)
            await self.idle.nap_now(r)
