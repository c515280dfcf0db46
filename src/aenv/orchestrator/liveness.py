"""Noticing sandboxes whose runtime died under them (the host's OOM killer at the memory
limit, a crashed sentry): they are reported lost with the cause, and what they held on the
node (memory budget, network slot, uppers, layer holds) is released, instead of being
listed `running` and answering 502 forever."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..domain import PauseTier, SandboxRecord, SandboxState
from ..runtime.base import Runtime
from . import eventrecords as ev
from .boot import Booter
from .events import Events
from .table import SandboxTable

log = logging.getLogger("aenv.orchestrator")


@dataclass
class Liveness:
    table: SandboxTable
    runtime: Runtime
    booter: Booter
    events: Events

    async def sweep(self) -> list[str]:
        """Checks every sandbox that should have live processes; returns the ones found
        dead. One whose lock is held is mid-operation (its instance may be changing) and is
        looked at on a later sweep."""
        dead = []
        for r in self.table.all():
            if not _should_run(r) or self.table.lock(r.sandbox_id).locked():
                continue
            assert r.instance is not None
            if await self.runtime.alive(r.instance):
                continue
            if await self._bury(r):
                dead.append(r.sandbox_id)
        return dead

    async def _bury(self, r: SandboxRecord) -> bool:
        async with self.table.lock(r.sandbox_id):
            inst = r.instance
            if not _should_run(r) or inst is None or await self.runtime.alive(inst):
                return False
            cause = await self.runtime.exit_cause(inst) or "its processes exited"
            await self.booter.destroy_quietly(inst)
            r.instance = None
            r.state = SandboxState.LOST
            r.note = f"it died while {'running' if r.paused is None else 'paused'}: {cause}"
            await self.table.save(r)
            await self.booter.forget(r)
        log.warning("sandbox %s died: %s", r.sandbox_id, cause)
        # The runtime's cause names the host's OOM kill at the cgroup's limit.
        reason = ev.KILL_OOM if "memory limit" in cause else ev.KILL_DIED
        self.events.record(
            ev.KILLED, r, kill_reason=reason, cause=cause, execution=self.events.execution(r)
        )
        return True


def _should_run(r: SandboxRecord) -> bool:
    if r.instance is None:
        return False
    if r.state is SandboxState.RUNNING:
        return True
    # A frozen sandbox keeps its processes; hibernated and files-only ones have none.
    return (
        r.state is SandboxState.PAUSED
        and r.paused is not None
        and r.paused.tier is PauseTier.FROZEN
    )
