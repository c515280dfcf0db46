"""What nodes and gateways exchange through Redis: typed, JSON on the wire."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

NodeStatus = Literal["ready", "draining"]


class RosterEntry(BaseModel):
    """One sandbox a node holds, as the gateways need it: where to route and whether it
    can move (hibernated and published to the shared repository: `image` names it)."""

    state: str
    tier: str | None = None
    image: str | None = None
    template_id: str | None = None
    started_at: str | None = None

    @property
    def movable(self) -> bool:
        return self.image is not None


class NodeRecord(BaseModel):
    """A node's registration, rewritten with every heartbeat (`heartbeat_at` and
    `started_at` are the node's own clock's: shown, never compared with another's)."""

    node_id: str
    url: str
    status: NodeStatus = "ready"
    heartbeat_at: float = Field(default_factory=time.time)
    started_at: float = Field(default_factory=time.time)
    version: str = ""
    cpu_count: int = 0
    memory_total_mb: int = 0
    memory_budget_mb: int = 0
    allocated_cpu: int = 0
    allocated_memory_mb: int = 0
    sandboxes: int = 0
    running: int = 0
    # Templates/snapshots whose layers (and image, if any) this node holds locally: the
    # scheduler prefers such a node for creates from them.
    templates: list[str] = Field(default_factory=list)
    # Filled in by the reader, never stored: when Redis took the last heartbeat and how
    # long ago that is, both by Redis's clock (so no two hosts' clocks need to agree), and
    # whether that is recent enough.
    seen_at: float = 0.0
    seen_ago: float = 0.0
    healthy: bool = True

    @property
    def free_memory_mb(self) -> int:
        return max(0, self.memory_budget_mb - self.allocated_memory_mb)

    @property
    def free_cpu(self) -> int:
        return max(0, self.cpu_count - self.allocated_cpu)

    @property
    def schedulable(self) -> bool:
        return self.healthy and self.status == "ready"
