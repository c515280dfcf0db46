"""The orchestrator: the node's core, built once, for `api/`, `proxy/`, `cluster/` and
`builds/`.

It composes the parts and exposes them; a caller calls the part that does the work, and
each part keeps the rules of its work (admission, operation counters, lifecycle log lines,
waking an idle sandbox first). The parts, as exposed:
    node            start-up/recovery, timers, shutdown          (node.py)
    table           records, per-sandbox locks, memory budget    (table.py)
    sandboxes       create, kill, timeouts, network, export      (sandboxes.py)
    pauser          pause tiers, resume, connect, proxy resolve  (pausing.py)
    snapshotter     snapshots                                    (snapshots.py)
    forker          fork                                         (fork.py)
    templates       catalog + layer holds + repository           (templates.py)
    metrics         sampled CPU/memory/disk per sandbox          (metrics.py)
    sampler         the periodic sampling round, naps follow it  (sampling.py)
    logs            node events + envd's journal per sandbox     (logs.py)
    events          lifecycle events, webhooks and their delivery (events.py)
    idle            naps and standby of idle sandboxes           (idle.py)
    liveness        sandboxes whose runtime died                 (liveness.py)
    stats           node view, operation counters, Prometheus    (nodeinfo.py)
    volumes         volumes and their files, kept while mounted  (volumes.py)
    mover           drain, release, adopt (cluster)              (moving.py)
    storage, bundle the layer store and uppers; envd's bundle    (storage.py)
    context         settings, clock, draining, stop listeners    (context.py)
and, not exposed: Booter (boot.py), WarmPool (pool.py), BootSnapshots (bootsnaps.py),
OomGuard (oom.py), Recovery (recovery.py).
What stays here combines parts: start and close, envd's calls into a sandbox, the proxy's
port forward and signed URLs, deleting a template. Parts call down or sideways to parts
built before them, never back up to this facade."""

from __future__ import annotations

import hmac
import logging
import os
from typing import Final

import httpx

from ..config import Settings
from ..domain import DEFAULT_TEMPLATE, LIVE_STATES, SandboxRecord, SandboxState
from ..egress import SecretLookup
from ..envd.files import file_signature
from ..envd_client import EnvdClient
from ..errors import AenvError, BadRequest
from ..runtime.base import Runtime
from ..runtime.bundle import EnvdBundle
from ..volumes import VolumeStore
from .boot import Booter
from .bootsnaps import BootSnapshots
from .catalog import Catalog
from .context import Clock, NodeContext
from .diffs import TreeDiffs
from .durable import Durable
from .envd_pool import EnvdPool
from .events import Events
from .fork import Forker
from .idle import IdleTracker
from .liveness import Liveness
from .logs import SandboxLogs
from .metrics import SandboxMetrics
from .moving import Mover
from .node import Node
from .nodeinfo import NodeStats, cache_sizes
from .oom import OomGuard
from .pausing import Pauser
from .pool import WarmPool
from .recovery import Recovery
from .rollback import Rollbacks
from .sampling import Sampler
from .sandboxes import Sandboxes
from .snapshots import Snapshotter
from .storage import SandboxStorage
from .table import SandboxTable
from .templates import TemplateRegistry
from .volumes import Volumes

log = logging.getLogger("aenv.orchestrator")


def _host_memory_mb() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20)


class Orchestrator:
    # The parts, read-only (see the module's docstring).
    settings: Final[Settings]
    context: Final[NodeContext]
    storage: Final[SandboxStorage]
    bundle: Final[EnvdBundle]
    table: Final[SandboxTable]
    templates: Final[TemplateRegistry]
    volumes: Final[Volumes]
    logs: Final[SandboxLogs]
    events: Final[Events]
    stats: Final[NodeStats]
    snapshotter: Final[Snapshotter]
    pauser: Final[Pauser]
    idle: Final[IdleTracker]
    sandboxes: Final[Sandboxes]
    forker: Final[Forker]
    liveness: Final[Liveness]
    node: Final[Node]
    metrics: Final[SandboxMetrics]
    sampler: Final[Sampler]
    mover: Final[Mover]
    diffs: Final[TreeDiffs]
    rollbacks: Final[Rollbacks]

    def __init__(
        self,
        settings: Settings,
        catalog: Catalog,
        runtime: Runtime,
        *,
        storage: SandboxStorage,
        bundle: EnvdBundle,
        durable: Durable | None = None,
        envd: EnvdPool | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings
        ctx = NodeContext(settings) if clock is None else NodeContext(settings, clock=clock)
        self.context = ctx
        self.storage = storage
        self.bundle = bundle
        self._envd = envd = envd or EnvdPool()
        self._runtime = runtime
        base = settings.max_memory_mb or int(_host_memory_mb() * 0.9)
        budget = int(base * settings.memory_overcommit)
        self.table = table = SandboxTable(catalog, budget, settings.max_sandboxes)
        self.templates = templates = TemplateRegistry(
            catalog, storage, durable, runtime.image_complete
        )
        store = VolumeStore(settings.volumes_dir)
        self.volumes = Volumes(store, table)
        self.logs = logs = SandboxLogs(ctx, table, envd)
        self.stats = stats = NodeStats(
            table,
            settings.home,
            lambda: ctx.closing or ctx.draining,
            cache_sizes(storage, durable),
            runtime.describe,
        )
        stats.node_id = settings.cluster_node_id
        stats.service_instance_id = ctx.run_id
        self.events = events = Events(ctx, stats.registry)
        booter = Booter(ctx, table, runtime, storage, envd, bundle, store)
        self.snapshotter = snapshotter = Snapshotter(
            ctx, table, booter, runtime, templates, stats, logs, events
        )
        self._boot_snapshots = boot = BootSnapshots(ctx, table, booter, snapshotter, templates)
        self.pauser = pauser = Pauser(ctx, table, booter, runtime, templates, stats, logs, events)
        # Made after the Pauser it uses: the parts made before it reach it through `ctx`.
        self.idle = idle = IdleTracker(ctx, table, runtime, pauser)
        pool = WarmPool(ctx, table, booter, templates, boot, idle)
        self.sandboxes = sandboxes = Sandboxes(
            ctx, table, booter, templates, pool, boot, runtime, storage, store, logs, stats, events
        )
        self.forker = Forker(ctx, table, snapshotter, sandboxes, templates, stats, logs, events)
        self.liveness = liveness = Liveness(table, runtime, booter, events)
        recovery = Recovery(ctx, table, runtime, booter, storage, templates, events)
        self.node = Node(
            ctx, table, runtime, templates, sandboxes, pauser, pool, envd, liveness, recovery
        )
        self.metrics = metrics = SandboxMetrics(ctx, table, runtime, storage)
        self.sampler = Sampler(table, metrics, idle, logs)
        OomGuard(ctx, table, runtime, envd, logs, stats, events)
        self.mover = Mover(ctx, table, booter, pauser, templates, storage, events)
        self.diffs = TreeDiffs(ctx, table, templates, storage, envd, runtime)
        self.rollbacks = Rollbacks(ctx, table, booter, templates, stats, logs, events)

    async def start(self, *, timers: bool = True) -> None:
        """Recovers what a previous run left and starts the timers and the sampler
        (`timers=False`: the caller drives `node.tick` and `sampler.round`, as the state
        machine's tests do). Events first: recovery records sandboxes it lost."""
        await self.events.start(timers=timers)
        await self.node.start(timers=timers)
        if timers:
            self.sampler.start()

    async def close(self) -> None:
        self.context.closing = True  # the node reports `draining` while it shuts down
        await self.sampler.stop()
        await self.node.close()
        await self.events.close()

    def use_secrets(self, lookup: SecretLookup) -> None:
        """Where the egress path reads the secrets that header transforms name (the
        composition root gives the node's secret store)."""
        self._runtime.use_secrets(lookup)

    def envd(self, r: SandboxRecord) -> EnvdClient:
        """Process and file calls to a running sandbox's envd, with its access token."""
        if r.address is None:
            raise BadRequest(f"sandbox {r.sandbox_id!r} is not running")
        return self._envd.at(r.address, r.envd_access_token)

    async def expose(self, sandbox_id: str, port: int) -> bool:
        """The proxy found `port` refused: asks the sandbox's envd to forward it if a process
        listens on it on loopback only. Whether a retry may now reach it."""
        r = self.table.find(sandbox_id)
        if r is None or r.state is not SandboxState.RUNNING or r.address is None:
            return False
        try:
            return await self._envd.at(r.address, r.envd_access_token).forward(port)
        except (AenvError, httpx.HTTPError, ValueError) as e:
            log.debug("no forward of port %s of %s: %s", port, sandbox_id, e)
            return False

    async def signed_by(
        self, path: str, op: str, user: str, signature: str, exp: str | None
    ) -> str | None:
        """The sandbox whose envd token made a signed file URL's signature, if any: such a
        URL made against a node address (`E2B_SANDBOX_URL`) names no sandbox. Async as the
        proxy's resolver is (a gateway's asks its nodes this, through the cluster API)."""
        want = signature.encode()
        for r in self.table.all():
            if r.state in LIVE_STATES and r.envd_access_token:
                mine = file_signature(path, op, user, r.envd_access_token, exp)
                if hmac.compare_digest(mine.encode(), want):
                    return r.sandbox_id
        return None

    async def delete_template(self, template_id: str) -> None:
        """Deletes a template and the boot snapshots made from it (never the default)."""
        rec = await self.templates.get(template_id)
        if rec.template_id == DEFAULT_TEMPLATE:
            raise BadRequest(f"the default template {DEFAULT_TEMPLATE!r} cannot be deleted")
        await self._boot_snapshots.forget_template(rec.template_id)
        await self.templates.delete(rec)
