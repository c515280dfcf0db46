"""The node's one periodic look at its sandboxes: every SAMPLE_SECONDS a round of metrics
samples (from the host's cgroups, no request into a sandbox), which also tells the idle
tracker which sandboxes went quiet. envd's journal is not read here: it is read when someone
asks for the logs, so an idle sandbox gets no request from the node."""

from __future__ import annotations

import logging

from aenv.background import Periodic

from .idle import IdleTracker
from .logs import SandboxLogs
from .metrics import SAMPLE_SECONDS, SandboxMetrics
from .table import SandboxTable

log = logging.getLogger("aenv.orchestrator")


class Sampler:
    def __init__(
        self, table: SandboxTable, metrics: SandboxMetrics, idle: IdleTracker, logs: SandboxLogs
    ) -> None:
        self.table, self.metrics, self.idle, self.logs = table, metrics, idle, logs
        self.timer = Periodic("metrics sampler", SAMPLE_SECONDS, self.round, log)

    async def round(self) -> None:
        taken = await self.metrics.sample_all()
        self.idle.forget({r.sandbox_id for r in self.table.all()})
        self.logs.prune()
        for r, s in taken:
            await self.idle.observe(r, s.cpu_used_pct / 100 * s.cpu_count)

    def start(self) -> None:
        self.timer.start()

    async def stop(self) -> None:
        await self.timer.stop()
