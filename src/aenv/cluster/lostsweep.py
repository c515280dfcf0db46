"""The gateway's look for nodes that stopped heartbeating: each sandbox that went with its
node (not hibernated into the shared repository, so nobody can resume it) is recorded killed
with `node_lost` at once, not only when someone next asks for it. One round per gateway every
few seconds, whatever the number of sandboxes (a dead node's roster is read once)."""

from __future__ import annotations

import logging

from aenv.background import Periodic
from aenv.config import Settings

from .gwevents import GatewayEvents
from .state import ClusterState

log = logging.getLogger("aenv.cluster")

SWEEP_SECONDS = 5.0


class LostSweep:
    def __init__(self, settings: Settings, state: ClusterState, events: GatewayEvents) -> None:
        self.settings, self.state, self.events = settings, state, events
        # The last heartbeat of each dead node already swept: a node seen dead again with
        # the same last heartbeat has nothing new to report.
        self._swept: dict[str, float] = {}
        self.timer = Periodic("lost-node sweep", SWEEP_SECONDS, self.round, log)

    async def start(self) -> None:
        self.timer.start()

    async def close(self) -> None:
        await self.timer.stop()

    async def round(self) -> int:
        """Records the sandboxes of newly dead nodes lost; how many it recorded."""
        recorded = 0
        for node in await self.state.nodes(self.settings.node_dead_after):
            if node.healthy:
                self._swept.pop(node.node_id, None)
                continue
            if self._swept.get(node.node_id) == node.seen_at:
                continue
            for sandbox_id, entry in (await self.state.roster(node.node_id)).items():
                if entry.movable:  # in the repository: its next request moves it
                    continue
                if await self.state.binding(sandbox_id) != node.node_id:
                    continue  # moved (or killed) meanwhile
                if await self.events.node_lost(sandbox_id, node.node_id, self.settings.api_key):
                    recorded += 1
            self._swept[node.node_id] = node.seen_at
        if recorded:
            log.info("%d sandbox(es) recorded lost with their node", recorded)
        return recorded
