"""The node's side of the cluster: a heartbeat every `heartbeat_seconds` that rewrites the
node's registration (capacity, usage, status, the templates it holds) and roster in Redis.
Redis being away is logged once and survived: the next heartbeat that gets through writes
everything again. At its first heartbeat the node also gives up the hibernated sandboxes
another node took over while it was away (their binding names that node). The node's secrets
are the cluster's: each change it makes goes to Redis, and each heartbeat takes the others'."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

from .. import __version__
from ..config import Settings
from ..domain import SandboxRecord, SandboxState
from ..orchestrator import Orchestrator
from ..secretstore import SecretStore
from .records import NodeRecord, RosterEntry
from .state import ClusterState

log = logging.getLogger("aenv.cluster")
MIB = 1024 * 1024


def advertise_url(settings: Settings) -> str:
    """Where gateways reach this node: AENV_ADVERTISE_URL, else its listener's address (the
    host's own address when it listens on all of them)."""
    if settings.advertise_url:
        return settings.advertise_url.rstrip("/")
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    return f"{settings.scheme}://{host}:{settings.port}"


def roster_entry(r: SandboxRecord) -> RosterEntry:
    p = r.paused
    return RosterEntry(
        state="paused" if r.shown_paused else "running",
        tier=None if r.tier is None else r.tier.value,
        # Published hibernations only: what another node can take over.
        image=p.image if r.tier is not None and p is not None and p.published else None,
        template_id=r.template_id,
        started_at=r.started_at.isoformat(),
    )


class NodeAgent:
    def __init__(
        self,
        settings: Settings,
        orchestrator: Orchestrator,
        state: ClusterState,
        secrets: SecretStore | None = None,
    ):
        self.settings = settings
        self.orch = orchestrator
        self.state = state
        self.secrets = secrets
        if secrets is not None:
            secrets.publish = state.put_secret
            secrets.refresh = self._take_secrets
        self.node_id = settings.cluster_node_id
        self.url = advertise_url(settings)
        self.started_at = time.time()
        self._previous: set[str] | None = None
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self._leaving = False

    async def start(self) -> None:
        await self._give_up_moved()
        await self.beat()
        self._task = asyncio.create_task(self._loop(), name="aenv-heartbeat")
        log.info("node %s joined the cluster at %s as %s", self.node_id, self.state.url, self.url)

    async def stopping(self) -> None:
        """The stop's first step, while the node still serves (`serving.StopsFirst`): the
        drain, whose hibernations end the sandboxes' open streams here."""
        await self._drain_on_stop()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._drain_on_stop()  # when the server did not call `stopping`
        with contextlib.suppress(Exception):
            await self.beat()
        await self.state.close()

    async def _drain_on_stop(self) -> None:
        """Moves every sandbox into the repository, then says so in one last heartbeat:
        gateways move each to another node at its next request (a container's stop would
        end them all otherwise). Once per process."""
        if self._leaving:
            return
        self._leaving = True  # every heartbeat from now on says "draining"
        with contextlib.suppress(Exception):
            await self.beat()  # going away: no new creates meanwhile
        if not (self.settings.drain_on_stop and self.orch.templates.has_repository):
            return
        started = time.monotonic()
        try:
            done = await self.orch.mover.drain()
        except Exception:
            log.exception("draining node %s at stop failed", self.node_id)
            return
        failed = [d for d in done if not d.published]
        for d in failed:
            log.warning("sandbox %s stays on node %s: %s", d.sandbox_id, self.node_id, d.error)
        log.info(
            "node %s drained at stop: %d of %d sandboxes in the repository (%.1f s)",
            self.node_id,
            len(done) - len(failed),
            len(done),
            time.monotonic() - started,
        )
        with contextlib.suppress(Exception):
            await self.beat()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_seconds)
            await self.beat()

    async def record(self) -> NodeRecord:
        info = await self.orch.stats.info()
        held = []
        for t in await self.orch.templates.all():
            if t.internal or not all(self.orch.storage.layers.has(d) for d in t.layers):
                continue
            held.append(t.template_id)
            held.extend(t.names)
        return NodeRecord(
            node_id=self.node_id,
            url=self.url,
            status="draining" if self._leaving or info.status == "draining" else "ready",
            started_at=self.started_at,
            version=__version__,
            cpu_count=info.cpu_count,
            memory_total_mb=info.memory_total_bytes // MIB,
            memory_budget_mb=info.memory_budget_bytes // MIB,
            allocated_cpu=info.allocated_cpu,
            allocated_memory_mb=info.allocated_memory_bytes // MIB,
            sandboxes=sum(
                info.counts.get(s.value, 0) for s in (SandboxState.RUNNING, SandboxState.PAUSED)
            ),
            running=info.running,
            templates=sorted(set(held)),
        )

    async def beat(self) -> None:
        try:
            node = await self.record()
            roster = {r.sandbox_id: roster_entry(r) for r in self.orch.table.list()}
            self._previous = await self.state.heartbeat(node, roster, self._previous)
            await self.orch.events.sync(*await self.state.webhooks())
            await self._take_secrets()
        except Exception as e:
            self._previous = None  # whatever Redis lost, the next heartbeat writes again
            if not self._failing:
                log.warning("heartbeat to %s failed: %s", self.state.url, e)
            self._failing = True
            return
        if self._failing:
            log.info("heartbeats to %s go through again", self.state.url)
        self._failing = False

    async def _take_secrets(self) -> None:
        if self.secrets is not None:
            await self.secrets.sync(*await self.state.secrets())

    async def _give_up_moved(self) -> None:
        for r in self.orch.table.list():
            try:
                owner = await self.state.binding(r.sandbox_id)
            except Exception as e:
                log.warning("cannot read the cluster's bindings: %s", e)
                return
            if owner is None or owner == self.node_id:
                continue
            if await self.state.roster_entry(owner, r.sandbox_id) is None:
                continue
            try:
                await self.orch.mover.release(r.sandbox_id)
                log.info(
                    "sandbox %s moved to node %s while this node was away", r.sandbox_id, owner
                )
            except Exception as e:
                log.warning("sandbox %s is also on node %s: %s", r.sandbox_id, owner, e)
