"""Boot snapshots: booting a sandbox costs `runsc run` plus envd's start-up inside gVisor
(~400 ms of CPU). Each node snapshots a freshly booted, warmed-up sandbox of the default
template at start, and of any other plain template and CPU count on first use (up to
MAX_BOOT_SNAPSHOTS shapes, only while half the memory budget is free); new sandboxes of that
template and CPU count, whatever their memory size (a restored sentry takes the new limit),
restore it instead. Made anew at each start of the node, never published."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..domain import DEFAULT_TEMPLATE, SandboxState, TemplateRecord, Timings
from .boot import Booter
from .context import NodeContext
from .snapshots import Snapshotter
from .table import SandboxTable
from .templates import TemplateRegistry

log = logging.getLogger("aenv.orchestrator")

# Template id and CPU count. Not the memory size: a restored sentry takes the new limit
# (a 512 MiB boot snapshot restores as a 256 MiB or 1 GiB sandbox, `free` says so).
BootKey = tuple[str, int]
# Shapes of sandbox a node keeps boot snapshots of (each ~20 MiB of memory image).
MAX_BOOT_SNAPSHOTS = 8
# Attempts at a boot snapshot of one shape before the node gives up on it for this run.
RETRIES = 3


@dataclass
class BootSnapshots:
    ctx: NodeContext
    table: SandboxTable
    booter: Booter
    snapshotter: Snapshotter
    templates: TemplateRegistry
    _made: dict[BootKey, TemplateRecord] = field(default_factory=dict, init=False)
    _tried: set[BootKey] = field(default_factory=set, init=False)
    _failed: dict[BootKey, int] = field(default_factory=dict, init=False)
    _cleaned: bool = field(default=False, init=False)

    def for_shape(self, tpl: TemplateRecord, cpu: int, mem: int) -> TemplateRecord | None:
        """The boot snapshot to restore a new sandbox of this template and size from, if
        there is a current one; asks for one to be made otherwise."""
        if not self.ctx.settings.boot_snapshots or tpl.has_memory or tpl.internal:
            return None  # (internal: a build step's transient template, used once)
        key = (tpl.template_id, cpu)
        found = self._made.get(key)
        if found is not None and found.boot_from_layers == tpl.layers:
            return found
        if key not in self._tried and len(self._tried) < MAX_BOOT_SNAPSHOTS:
            default_mem = tpl.memory_mb or self.ctx.settings.default_memory_mb
            self.ctx.spawn(self._ensure(tpl.template_id, cpu, default_mem), detached=True)
        return None

    async def prepare(self) -> None:
        """Once per run: drops earlier runs' boot snapshots (the envd bundle or runsc may have
        changed) and makes the default template's."""
        if self._cleaned or not self.ctx.settings.boot_snapshots:
            return
        self._cleaned = True
        for old in await self.templates.all():
            if old.boot_of and old.boot_run != self.ctx.run_id:
                await self.templates.delete(old)
        tpl = await self.templates.find(DEFAULT_TEMPLATE)
        if tpl is not None:
            s = self.ctx.settings
            cpu = tpl.cpu_count or s.default_cpu_count
            mem = tpl.memory_mb or s.default_memory_mb
            await self._ensure(tpl.template_id, cpu, mem)

    async def forget_template(self, template_id: str) -> None:
        """Deletes the boot snapshots of a template that goes."""
        for key, snap in list(self._made.items()):
            if key[0] == template_id:
                del self._made[key]
                await self.templates.delete(snap)

    async def _ensure(self, template_id: str, cpu: int, mem: int) -> None:
        key = (template_id, cpu)
        if key in self._tried or self.ctx.closing:
            return
        if self.table.memory_in_use() + mem > self.table.memory_budget_mb // 2:
            return  # speculative: never with memory users may be about to ask for (later)
        self._tried.add(key)
        try:
            # Speculative work: behind the boots already queued (a burst of creates of this
            # new shape would pay for it); the burst's followers get it.
            await self.booter.queue_behind()
            await self._make(template_id, cpu, mem)
        except Exception as e:
            log.warning("no boot snapshot of %s (%d CPU, %d MiB): %s", template_id, cpu, mem, e)
            # One failed boot (a busy host) must not leave every later create booting: the
            # next create of this shape tries again, a few times at most.
            self._failed[key] = self._failed.get(key, 0) + 1
            if self._failed[key] < RETRIES:
                self._tried.discard(key)

    async def _make(self, template_id: str, cpu: int, mem: int) -> None:
        """Boots one sandbox of the template, lets envd start and run one login shell, and
        snapshots it; the sandbox itself is dropped."""
        tpl = await self.templates.find(template_id)
        if tpl is None or tpl.has_memory:
            return
        self.table.reserve(mem)
        t = Timings()
        r = await self.booter.preboot(tpl, cpu, mem, alias=None, boot=None, timings=t)
        try:
            r.state = SandboxState.RUNNING
            async with self.table.lock(r.sandbox_id):
                snap, back = await self.snapshotter.take(
                    r, t, names=[], internal=True, restore_later=True, boot_of=tpl
                )
            if back is not None:
                back.close()  # the source is not wanted back
        finally:
            if r.instance:
                await self.booter.destroy_quietly(r.instance)
            await self.table.delete(r)
            await self.booter.forget(r)
        self._made[(tpl.template_id, cpu)] = snap
        log.info(
            "boot snapshot %s of %s (%d CPU, %d MiB) ready",
            snap.template_id,
            tpl.template_id,
            cpu,
            mem,
        )
