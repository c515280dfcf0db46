"""The gateway's view of the cluster: the nodes (from Redis, refreshed every second, and
filtered by Kubernetes discovery when configured) and where each sandbox is (its binding,
cached briefly), with the move of a hibernated sandbox off a lost or draining node."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ..config import Settings
from ..errors import BadGateway, NotFound, Unavailable
from .records import NodeRecord
from .scheduler import Placement, Scheduler
from .state import ClusterState

log = logging.getLogger("aenv.cluster")

NODES_FRESH_SECONDS = 1.0
BINDING_FRESH_SECONDS = 5.0

# (node, sandbox id) -> the image the node gave up (release), for the node that takes over;
# None when the sandbox cannot move (not hibernated into the repository).
Release = Callable[[NodeRecord, str], Awaitable[str | None]]
# (node, sandbox id, image): the node adopts the sandbox.
Adopt = Callable[[NodeRecord, str, str], Awaitable[None]]
# The URLs and names of the nodes Kubernetes lists as ready (None: no list yet, or no
# discovery configured); read on the request path, so it must answer from memory.
Discover = Callable[[], set[str] | None]


class NodeLost(BadGateway):
    """A sandbox's node does not answer: E2B's edge status for a sandbox it cannot reach."""

    def __init__(self, sandbox_id: str, node: NodeRecord) -> None:
        ago = int(node.seen_ago)
        super().__init__(
            f"sandbox {sandbox_id!r} is on node {node.node_id!r}, which is unreachable "
            f"(no heartbeat for {ago} s)"
        )
        self.sandbox_id = sandbox_id
        self.node_id = node.node_id

    def to_json(self) -> dict[str, object]:
        return {**super().to_json(), "sandboxId": self.sandbox_id}


class Directory:
    def __init__(
        self,
        settings: Settings,
        state: ClusterState,
        scheduler: Scheduler,
        discover: Discover | None = None,
    ) -> None:
        self.settings = settings
        self.state = state
        self.scheduler = scheduler
        self.discover = discover
        self._moving: dict[str, asyncio.Lock] = {}
        self._nodes: list[NodeRecord] = []
        self._nodes_at = 0.0
        self._refresh: asyncio.Lock = asyncio.Lock()
        self._bindings: dict[str, tuple[str, float]] = {}

    # ------------------------------------------------------------------ nodes
    async def nodes(self, *, fresh: bool = False) -> list[NodeRecord]:
        if fresh or time.monotonic() - self._nodes_at > NODES_FRESH_SECONDS:
            async with self._refresh:
                if fresh or time.monotonic() - self._nodes_at > NODES_FRESH_SECONDS:
                    nodes = await self.state.nodes(self.settings.node_dead_after)
                    ready = None if self.discover is None else self.discover()
                    if ready is not None:
                        for n in nodes:
                            n.healthy = n.healthy and (n.url in ready or n.node_id in ready)
                    self._nodes, self._nodes_at = nodes, time.monotonic()
        return list(self._nodes)

    def invalidate(self) -> None:
        """The next read of the node table goes to Redis."""
        self._nodes_at = 0.0

    async def node(self, node_id: str) -> NodeRecord:
        for n in await self.nodes():
            if n.node_id == node_id:
                return n
        for n in await self.nodes(fresh=True):
            if n.node_id == node_id:
                return n
        raise NotFound(f"node {node_id!r} not found")

    async def healthy(self) -> list[NodeRecord]:
        return [n for n in await self.nodes() if n.healthy]

    async def schedulable(self) -> list[NodeRecord]:
        return [n for n in await self.nodes() if n.schedulable]

    async def any_node(self) -> NodeRecord:
        """A healthy node for requests about no sandbox in particular (the first by id, so
        the same node answers while it is up)."""
        nodes = await self.healthy()
        ready = [n for n in nodes if n.status == "ready"] or nodes
        if not ready:
            raise Unavailable("no node of the cluster is healthy")
        return ready[0]

    # ------------------------------------------------------------------ bindings
    def remember(self, sandbox_id: str, node_id: str) -> None:
        self._bindings[sandbox_id] = (node_id, time.monotonic())

    def forget(self, sandbox_id: str) -> None:
        self._bindings.pop(sandbox_id, None)

    async def bind(self, sandbox_id: str, node_id: str) -> None:
        await self.state.bind(sandbox_id, node_id)
        self.remember(sandbox_id, node_id)

    async def _owner(self, sandbox_id: str, *, fresh: bool = False) -> str | None:
        cached = self._bindings.get(sandbox_id)
        if not fresh and cached and time.monotonic() - cached[1] < BINDING_FRESH_SECONDS:
            return cached[0]
        node_id = await self.state.binding(sandbox_id)
        if node_id is None:
            # A binding Redis lost (restarted) that no heartbeat rewrote yet: the rosters.
            node_id = await self.state.find(sandbox_id, [n.node_id for n in await self.nodes()])
        if node_id is None:
            self.forget(sandbox_id)
            return None
        self.remember(sandbox_id, node_id)
        return node_id

    async def locate(self, sandbox_id: str) -> NodeRecord:
        """The node holding a sandbox; NotFound if none does."""
        node_id = await self._owner(sandbox_id)
        if node_id is None:
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        try:
            return await self.node(node_id)
        except NotFound:
            raise NotFound(f"sandbox {sandbox_id!r} not found") from None

    async def usable(
        self, sandbox_id: str, release: Release, adopt: Adopt, *, resume: bool
    ) -> NodeRecord:
        """The node to send a request about the sandbox to. A sandbox on a lost node (or,
        when it is to be resumed, a draining one) that is hibernated in the repository
        moves to another node first; on a lost node otherwise it is a clear 502 at once."""
        node = await self.locate(sandbox_id)
        if node.healthy and not (resume and node.status == "draining"):
            return node
        lock = self._moving.setdefault(sandbox_id, asyncio.Lock())
        try:
            async with lock:
                return await self._usable_locked(sandbox_id, node, release, adopt, resume)
        finally:
            if not lock.locked():
                self._moving.pop(sandbox_id, None)

    async def _usable_locked(
        self, sandbox_id: str, node: NodeRecord, release: Release, adopt: Adopt, resume: bool
    ) -> NodeRecord:
        # Another request (or gateway) may have moved it meanwhile.
        node_id = await self._owner(sandbox_id, fresh=True)
        if node_id is not None and node_id != node.node_id:
            node = await self.node(node_id)
            if node.healthy and not (resume and node.status == "draining"):
                return node
        targets = [n for n in await self.schedulable() if n.node_id != node.node_id]
        entry = await self.state.roster_entry(node.node_id, sandbox_id)
        if node.healthy:
            # Draining: the node itself says whether the sandbox can move (its roster in
            # Redis may be a heartbeat behind the drain).
            try:
                image = await release(node, sandbox_id) if targets else None
            except BadGateway:
                # It stopped answering before its heartbeats ran out (a node stopping after
                # its drain): the roster says whether the sandbox went into the repository.
                if entry is None or not entry.movable or entry.image is None:
                    raise
                image = entry.image
            if image is None:
                return node  # it cannot move (or nowhere to): it resumes where it is
        elif entry is None or not entry.movable or entry.image is None:
            raise NodeLost(sandbox_id, node)
        elif not targets:
            raise Unavailable(f"no other node can take sandbox {sandbox_id!r} over")
        else:
            image = entry.image
        template = entry.template_id if entry is not None else None
        target = self.scheduler.place(Placement(template or "", 0, 0), targets)
        try:
            await adopt(target, sandbox_id, image)
        except Exception:
            if node.healthy:  # given up by its node: it takes it back rather than lose it
                await adopt(node, sandbox_id, image)
            raise
        await self.bind(sandbox_id, target.node_id)
        log.info(
            "sandbox %s moved from node %s to node %s", sandbox_id, node.node_id, target.node_id
        )
        return target
