"""Per-sandbox metrics: a sample of every running sandbox every few seconds (CPU and memory
from its host cgroup through `Runtime.stats`, disk from its own disk image), kept in a
bounded ring per sandbox for as long as the sandbox exists, paused ones included (they keep
what was recorded; nothing is sampled while they are paused)."""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from ..domain import SandboxRecord, SandboxState
from ..errors import AenvError
from ..logctx import sandbox_context
from ..runtime.base import Runtime
from .context import NodeContext
from .storage import SandboxStorage
from .table import SandboxTable

log = logging.getLogger("aenv.orchestrator")

# E2B's collection interval; its SDK tests allow one interval of slack around a range.
SAMPLE_SECONDS = 5.0
# Samples kept per sandbox: two hours at SAMPLE_SECONDS.
RING_SIZE = 1440


@dataclass(frozen=True)
class MetricSample:
    at: datetime
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    mem_cache: int
    disk_used: int
    disk_total: int


class SandboxMetrics:
    def __init__(
        self,
        ctx: NodeContext,
        table: SandboxTable,
        runtime: Runtime,
        storage: SandboxStorage,
        ring_size: int | None = None,
    ) -> None:
        self.ctx = ctx
        self.table = table
        self.runtime = runtime
        self.storage = storage
        self.ring_size = ring_size or RING_SIZE
        self._rings: dict[str, collections.deque[MetricSample]] = {}

    async def sample_all(self) -> list[tuple[SandboxRecord, MetricSample]]:
        """One round: a sample of each running sandbox, returned with its record; rings of
        sandboxes gone dropped."""
        records = self.table.all()
        live = {r.sandbox_id for r in records}
        for gone in self._rings.keys() - live:
            del self._rings[gone]
        taken = []
        for r in records:
            if r.in_standby_on_disk:
                self._still(r)
            elif r.state is SandboxState.RUNNING and r.instance is not None:
                with sandbox_context(r.sandbox_id):
                    s = await self.sample(r)
                if s is not None:
                    taken.append((r, s))
        return taken

    async def sample(self, r: SandboxRecord) -> MetricSample | None:
        inst = r.instance
        if inst is None:
            return None
        try:
            stats = await self.runtime.stats(inst)
            used, total = await asyncio.to_thread(self.storage.disk_usage, r.sandbox_id, r.disk_mb)
        except (AenvError, OSError) as e:
            # Paused or killed between the table read and now: nothing to record.
            log.debug("no metrics sample of %s: %s", r.sandbox_id, e)
            return None
        s = MetricSample(
            at=self.ctx.now(),
            cpu_count=r.cpu_count,
            cpu_used_pct=stats.cpu_used_pct,
            mem_used=stats.mem_used_bytes,
            mem_total=stats.mem_total_bytes,
            mem_cache=0,
            disk_used=used,
            disk_total=total,
        )
        ring = self._rings.get(r.sandbox_id)
        if ring is None:
            ring = self._rings[r.sandbox_id] = collections.deque(maxlen=self.ring_size)
        ring.append(s)
        return s

    def _still(self, r: SandboxRecord) -> None:
        """A sandbox in standby on disk is running to its user: its series goes on, idle, at
        its last memory and disk."""
        ring = self._rings.get(r.sandbox_id)
        if ring:
            ring.append(replace(ring[-1], at=self.ctx.now(), cpu_used_pct=0.0))

    def series(
        self, sandbox_id: str, start: datetime | None = None, end: datetime | None = None
    ) -> list[MetricSample]:
        """The sandbox's recorded samples in [start, end] (seconds resolution, as E2B's
        query), oldest first; none from before the sandbox was handed out (a pool
        sandbox's)."""
        return self._series(self.table.get(sandbox_id), start, end)

    def latest(self, sandbox_id: str) -> MetricSample | None:
        """The sandbox's last sample, if any (none for a sandbox gone)."""
        r = self.table.find(sandbox_id)
        found = None if r is None else self._series(r)
        return found[-1] if found else None

    def _series(
        self, r: SandboxRecord, start: datetime | None = None, end: datetime | None = None
    ) -> list[MetricSample]:
        lo = r.started_at - timedelta(seconds=1)
        if start is not None:
            lo = max(lo, start)
        hi = None if end is None else end + timedelta(seconds=1)
        return [
            s for s in self._rings.get(r.sandbox_id, ()) if s.at >= lo and (hi is None or s.at < hi)
        ]
