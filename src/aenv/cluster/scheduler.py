"""Where a create goes. The default places it on the schedulable node with the most free
memory (budget minus what its sandboxes hold), then the most free CPUs, preferring a node
that already holds the template's or snapshot's layers while it has half as much room. Another
policy plugs in with AENV_SCHEDULER=module:attribute (a class taking no arguments)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import Unavailable
from .records import NodeRecord

# A node holding the layers wins while it has at least 1/LOCALITY_FACTOR of the best free memory.
LOCALITY_FACTOR = 2


@dataclass(frozen=True)
class Placement:
    """What the scheduler knows of a create."""

    template_id: str
    cpu_count: int
    memory_mb: int


class Scheduler(Protocol):
    def place(self, request: Placement, nodes: list[NodeRecord]) -> NodeRecord:
        """One of `nodes` (all schedulable), or raises Unavailable."""
        ...


@dataclass
class LeastLoaded:
    # Creates placed since a node's last heartbeat are not in its figures yet: counted here
    # so a burst of creates spreads instead of all landing on the node that looked emptiest.
    _recent: dict[str, list[tuple[float, int, int]]] = field(default_factory=dict)

    def place(self, request: Placement, nodes: list[NodeRecord]) -> NodeRecord:
        if not nodes:
            raise Unavailable("no node is ready to take sandboxes")

        def room(n: NodeRecord) -> tuple[int, int]:
            # Stamped with the heartbeat they were placed after: one newer counts them.
            pending = [p for p in self._recent.get(n.node_id, []) if p[0] >= n.seen_at]
            self._recent[n.node_id] = pending
            mem = n.free_memory_mb - sum(p[1] for p in pending)
            cpu = n.free_cpu - sum(p[2] for p in pending)
            return mem, cpu

        rooms = {n.node_id: room(n) for n in nodes}
        fits = [n for n in nodes if rooms[n.node_id][0] >= request.memory_mb] or nodes
        best = max(fits, key=lambda n: (*rooms[n.node_id], n.node_id))
        local = [n for n in fits if request.template_id in n.templates]
        if local and best not in local:
            # Locality saves a download, not worth loading one node far above the others.
            near = max(local, key=lambda n: (*rooms[n.node_id], n.node_id))
            if rooms[near.node_id][0] * LOCALITY_FACTOR >= rooms[best.node_id][0]:
                best = near
        self._recent.setdefault(best.node_id, []).append(
            (best.seen_at, request.memory_mb, request.cpu_count)
        )
        return best


def load_scheduler(spec: str) -> Scheduler:
    if spec == "least-loaded":
        return LeastLoaded()
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"AENV_SCHEDULER={spec!r}: use least-loaded or module:attribute")
    factory = getattr(importlib.import_module(module), attr)
    scheduler: Scheduler = factory()
    return scheduler
