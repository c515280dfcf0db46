"""Which running sandboxes are idle: their naps (`runtime/naps.py`) and standby.

A sandbox **naps** once it has had no request for `nap_after` seconds and the metrics
sampler saw it use next to no CPU; the next request of any kind (`wake`: the proxy's
resolve, an operation on it, a logs read) ends the nap before it is forwarded. A nap never
stops anything inside: a background job that starts working while its sandbox naps shows in
the next sample and ends the nap too, and that sandbox is then left awake for a while
(`BUSY_HOLD`), so that a job that works in bursts does not nap between them.

**Standby** (opt-in: `standbyAfter` at create, or `AENV_STANDBY_AFTER` for the node) goes
further for a sandbox that napped calmly (no CPU of its own at all) and had no request for
its `standby_after` seconds: its processes are frozen (the cgroup freezer: no CPU, memory
kept). To its user it is still running: listed and shown as running, its timeout and
metrics go on, and the next request of any kind thaws it (a few ms) before it is forwarded.
A sandbox whose background job does anything is never frozen.

**Standby on disk**: one in standby for `standby_disk_after` seconds more is hibernated (its
memory released; `Pauser.to_disk`), still running to its user; its next request restores it
first. Sooner when memory is short: a create or resume that the budget cannot hold sends the
sandboxes in standby that had no request for longest to disk (`make_room`), so a node holds
as many running as memory allows and the rest on disk.

No timer of its own: it is told of requests as they come and of CPU use by the sampler's
one round over all sandboxes, so an idle node does no per-sandbox work for it."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from ..domain import SandboxRecord, SandboxState
from ..runtime.base import Instance, Runtime
from .context import NodeContext
from .pausing import Pauser
from .table import SandboxTable

log = logging.getLogger("aenv.orchestrator")

# Cores. An idle sandbox awake costs 0.025-0.035 here (its sentry's own timers); one whose
# processes work costs more.
NAP_CPU = 0.06
# Cores: napping, an idle sandbox costs under 0.001; more means something inside works.
WAKE_CPU = 0.02
# Cores: napping and under this, nothing inside runs at all (standby may freeze it).
CALM_CPU = 0.002
# After a nap ended because the sandbox worked: no nap again for this long.
BUSY_HOLD = timedelta(seconds=60)
# Standby sandboxes checkpointed to disk at once by the sampler's rounds (each a burst of CPU).
DISK_MOVES = 2


@dataclass
class _Idle:
    last_request: datetime
    napping: Instance | None = None
    frozen: Instance | None = None  # in standby
    frozen_at: datetime | None = None
    hold_until: datetime | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class IdleTracker:
    def __init__(
        self, ctx: NodeContext, table: SandboxTable, runtime: Runtime, pauser: Pauser
    ) -> None:
        self.ctx = ctx
        self.table = table
        self.runtime = runtime
        self.pauser = pauser
        self._state: dict[str, _Idle] = {}
        self._disk_moves = asyncio.Semaphore(DISK_MOVES)
        # The parts made before it reach it through `ctx`; the table asks it for room
        # (sandboxes put into standby) when a create finds the memory budget full.
        ctx.track_idle(self)
        table.room_maker = self.make_room

    @property
    def nap_after(self) -> float:
        return self.ctx.settings.nap_after

    def standby_after(self, r: SandboxRecord) -> float:
        """The sandbox's own setting, else the node's; 0: never."""
        own = r.standby_after
        return float(own if own is not None else self.ctx.settings.standby_after)

    def _of(self, sandbox_id: str) -> _Idle:
        s = self._state.get(sandbox_id)
        if s is None:
            s = self._state[sandbox_id] = _Idle(last_request=self.ctx.now())
        return s

    def napping(self, sandbox_id: str) -> bool:
        s = self._state.get(sandbox_id)
        return s is not None and s.napping is not None

    def in_standby(self, sandbox_id: str) -> bool:
        s = self._state.get(sandbox_id)
        return s is not None and s.frozen is not None

    def touch(self, sandbox_id: str) -> None:
        """A request for the sandbox came: its idle time starts again."""
        self._of(sandbox_id).last_request = self.ctx.now()

    async def wake(self, sandbox_id: str, *, restore: bool = True) -> None:
        """A request is about to reach the sandbox: standby and nap, if any, end first; one
        in standby on disk is restored (`restore=False`: left there, for a kill or pause)."""
        s = self._of(sandbox_id)
        s.last_request = self.ctx.now()
        r = self.table.find(sandbox_id)
        if restore and r is not None and r.in_standby_on_disk:
            await self.pauser.restore_standby(sandbox_id)
            return
        if s.napping is None and s.frozen is None:
            return
        async with s.lock:
            if s.frozen is not None:
                inst, s.frozen = s.frozen, None
                try:
                    await self.runtime.thaw(inst)
                except Exception as e:  # gone meanwhile: the request finds out by itself
                    log.debug("thawing %s from standby: %s", sandbox_id, e)
            if s.napping is not None:
                inst, s.napping = s.napping, None
                await self._nap(inst, False)

    async def nap_now(self, r: SandboxRecord) -> None:
        """Naps a sandbox nobody uses yet (a warm pool's) at once."""
        if self.nap_after > 0 and r.instance is not None:
            s = self._of(r.sandbox_id)
            s.napping = r.instance
            await self._nap(r.instance, True)

    async def observe(self, r: SandboxRecord, cpu_cores: float) -> None:
        """The sampler's reading of a running sandbox's CPU use since its last one."""
        if self.nap_after <= 0 or r.instance is None:
            return
        s = self._of(r.sandbox_id)
        if s.lock.locked():
            return
        now = self.ctx.now()
        if s.frozen is not None:
            disk_after = self.ctx.settings.standby_disk_after
            since = s.frozen_at or now
            if disk_after > 0 and (now - since).total_seconds() >= disk_after:
                self.ctx.spawn(self._to_disk_soon(r.sandbox_id))
            return
        quiet = (now - s.last_request).total_seconds()
        if s.napping is not None:
            if cpu_cores > WAKE_CPU:
                async with s.lock:
                    inst, s.napping = s.napping, None
                    s.hold_until = now + BUSY_HOLD
                    await self._nap(inst, False)
                return
            standby = self.standby_after(r)
            if standby > 0 and cpu_cores < CALM_CPU and quiet >= standby:
                await self._freeze(r, s)
            return
        if cpu_cores >= NAP_CPU or (s.hold_until is not None and now < s.hold_until):
            return
        if quiet < self.nap_after:
            return
        s.napping = r.instance
        await self._nap(r.instance, True)

    async def _freeze(self, r: SandboxRecord, s: _Idle) -> None:
        op = self.table.lock(r.sandbox_id)
        if op.locked():
            return  # an operation is on it: not idle after all
        async with s.lock, op:
            inst = r.instance
            if r.state is not SandboxState.RUNNING or inst is None or s.frozen is not None:
                return
            try:
                await self.runtime.freeze(inst)
            except Exception as e:
                log.debug("standby of %s: %s", r.sandbox_id, e)
                return
            s.frozen, s.frozen_at = inst, self.ctx.now()
        log.info("sandbox %s in standby (frozen until its next request)", r.sandbox_id)

    async def _to_disk_soon(self, sandbox_id: str) -> None:
        async with self._disk_moves:
            await self._to_disk(sandbox_id)

    async def _to_disk(self, sandbox_id: str) -> bool:
        """Hibernates a sandbox still in standby; whether it went."""
        s = self._state.get(sandbox_id)
        if s is None or s.frozen is None:
            return False
        async with s.lock:
            inst = s.frozen
            if inst is None:
                return False
            s.napping = None  # the runtime's checkpoint wakes the sentry first
            try:
                went = await self.pauser.to_disk(sandbox_id, inst)
            except Exception as e:  # still frozen, in standby: its next request thaws it
                log.warning("standby of %s to disk: %s", sandbox_id, e)
                s.frozen_at = self.ctx.now()  # the timer's next try after as long again
                return False
            if went:
                s.frozen = s.frozen_at = s.napping = None
            return went

    async def make_room(self, memory_mb: int) -> int:
        """Frees `memory_mb` of the node's budget if it can: sandboxes in standby go to disk,
        those without a request for longest first. How many MiB it freed."""
        freed = 0
        standby = sorted(
            (s.last_request, sandbox_id)
            for sandbox_id, s in self._state.items()
            if s.frozen is not None and not s.lock.locked()
        )
        for _, sandbox_id in standby:
            if freed >= memory_mb:
                break
            r = self.table.find(sandbox_id)
            if r is not None and await self._to_disk(sandbox_id):
                freed += r.memory_mb
        if not freed:
            napping = sum(1 for s in self._state.values() if s.napping is not None)
            log.info(
                "no room for %d MiB: of %d sandboxes in standby none could go to disk (%d napping)",
                memory_mb,
                len(standby),
                napping,
            )
        return freed

    def forget(self, keep: set[str]) -> None:
        """Drops what is known of sandboxes not in `keep` (gone from the node)."""
        for gone in self._state.keys() - keep:
            del self._state[gone]

    async def _nap(self, inst: Instance, on: bool) -> None:
        try:
            await self.runtime.nap(inst, on)
        except Exception as e:  # a nap is an optimisation: never fail a request for it
            log.debug("nap %s of %s: %s", "on" if on else "off", inst.id, e)
