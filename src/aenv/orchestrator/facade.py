"""The orchestrator: the one door into the node's core for `api/`, `proxy/` and `builds/`.

It composes the parts, each with one job, and only delegates:
    Node            start-up/recovery, timers, shutdown          (node.py)
    SandboxTable    records, per-sandbox locks, memory budget     (table.py)
    Booter          specs, boot slots, boot/restore, seal, squash (boot.py)
    WarmPool        pre-booted sandboxes                          (pool.py)
    BootSnapshots   snapshots of freshly booted sandboxes         (bootsnaps.py)
    Sandboxes       create, kill, timeouts, export                (sandboxes.py)
    Pauser          pause tiers, resume, connect, proxy resolve   (pausing.py)
    Snapshotter     snapshots                                     (snapshots.py)
    Forker          fork                                          (fork.py)
    TemplateRegistry catalog + layer holds + repository           (templates.py)
    SandboxMetrics  sampled CPU/memory/disk per sandbox           (metrics.py)
    Sampler         the periodic sampling round, naps follow it   (sampling.py)
    SandboxLogs     node events + envd's journal per sandbox      (logs.py)
    IdleTracker     naps and standby of idle sandboxes            (idle.py)
    OomGuard        a process killed inside at the memory limit   (oom.py)
    NodeStats       node view, operation counters, Prometheus     (nodeinfo.py)
    VolumeStore     volumes and their files                       (aenv.volumes)
    Mover           drain, release, adopt (cluster)               (moving.py)
Parts call down or sideways to parts built before them, never back up to this facade."""

from __future__ import annotations

import asyncio
import builtins
import hmac
import logging
import os
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from ..config import Settings
from ..domain import (
    DEFAULT_TEMPLATE,
    LIVE_STATES,
    BuildInfo,
    CreateRequest,
    EgressPolicy,
    Quota,
    SandboxRecord,
    SandboxState,
    TemplateRecord,
    Timings,
    Upstream,
)
from ..envd.files import file_signature
from ..envd_client import EnvdClient
from ..errors import AenvError, BadRequest, Conflict
from ..images.cache import holder
from ..images.pull import PulledImage, pull
from ..runtime.base import Runtime
from ..runtime.bundle import EnvdBundle
from ..volumes import VolumeFiles, VolumeRecord, VolumeStore
from .boot import Booter
from .bootsnaps import BootSnapshots
from .catalog import Catalog
from .context import Clock, NodeContext, check_timeout
from .durable import Durable
from .envd_pool import EnvdPool
from .fork import Forker, ForkResult
from .idle import IdleTracker
from .liveness import Liveness
from .logs import LogEntry, SandboxLogs
from .metrics import MetricSample, SandboxMetrics
from .moving import DrainResult, Mover
from .node import Node
from .nodeinfo import NodeInfo, NodeStats, cache_sizes
from .oom import OomGuard
from .pausing import Pauser
from .pool import WarmPool
from .recovery import Recovery
from .sampling import Sampler
from .sandboxes import Sandboxes
from .snapshots import Snapshotter
from .storage import SandboxStorage
from .table import SandboxTable
from .templates import TemplateRegistry

_ENDED = (SandboxState.KILLED, SandboxState.LOST)

log = logging.getLogger("aenv.orchestrator")


def _host_memory_mb() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20)


class Orchestrator:
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
        self._ctx = ctx
        self._storage = storage
        self._bundle = bundle
        envd = envd or EnvdPool()
        self._envd = envd
        base = settings.max_memory_mb or int(_host_memory_mb() * 0.9)
        budget = int(base * settings.memory_overcommit)
        self._table = table = SandboxTable(catalog, budget, settings.max_sandboxes)
        self._templates = templates = TemplateRegistry(
            catalog, storage, durable, runtime.image_complete
        )
        self._volumes = volumes = VolumeStore(settings.volumes_dir)
        self._logs = logs = SandboxLogs(table, envd)
        self._stats = stats = NodeStats(
            table,
            settings.home,
            lambda: ctx.closing or ctx.draining,
            cache_sizes(storage, durable),
        )
        stats.node_id = settings.cluster_node_id
        booter = Booter(ctx, table, runtime, storage, envd, bundle, volumes)
        self._snapshotter = snapshotter = Snapshotter(ctx, table, booter, runtime, templates)
        self._boot_snapshots = boot = BootSnapshots(ctx, table, booter, snapshotter, templates)
        self._pauser = pauser = Pauser(ctx, table, booter, runtime, templates)
        self._idle = idle = IdleTracker(ctx, table, runtime, pauser)
        table.room_maker = idle.make_room
        pool = WarmPool(ctx, table, booter, templates, boot, idle)
        self._sandboxes = sandboxes = Sandboxes(
            ctx, table, booter, templates, pool, boot, runtime, storage, volumes, logs, stats
        )
        self._forker = Forker(ctx, table, snapshotter, sandboxes, templates)
        self._liveness = liveness = Liveness(table, runtime, booter)
        recovery = Recovery(ctx, table, runtime, booter, storage, templates)
        self._node = Node(
            ctx, table, runtime, templates, sandboxes, pauser, pool, envd, liveness, recovery
        )
        self._metrics = metrics = SandboxMetrics(ctx, table, runtime, storage)
        self._sampler = Sampler(table, metrics, idle, logs)
        OomGuard(ctx, table, runtime, envd, self._logs, self._stats)
        self._mover = Mover(ctx, table, booter, pauser, templates, storage)
        self._stats.service_instance_id = ctx.run_id

    # ------------------------------------------------------------------ the node
    async def start(self, *, timers: bool = True) -> None:
        """Recovers what a previous run left and starts the timers (`timers=False`: the
        caller drives `tick`, as the state machine's tests do)."""
        await self._node.start(timers=timers)
        if timers:
            self._sampler.start()

    async def close(self) -> None:
        self._ctx.closing = True  # the node reports `draining` while it shuts down
        await self._sampler.stop()
        await self._node.close()

    async def tick(self) -> None:
        await self._node.tick()

    async def sweep_dead(self) -> builtins.list[str]:
        """Finds sandboxes whose runtime died now (the timers do it every few seconds)."""
        return await self._liveness.sweep()

    async def settle(self) -> None:
        """Waits for the background work started so far (publishes, squashes)."""
        await self._ctx.join()

    @property
    def memory_budget_mb(self) -> int:
        return self._table.memory_budget_mb

    def check_timeout(self, timeout: int | None) -> None:
        check_timeout(timeout, self.settings)

    # ------------------------------------------------------------------ sandboxes
    def get(self, sandbox_id: str) -> SandboxRecord:
        return self._table.get(sandbox_id)

    def list(
        self,
        *,
        metadata: dict[str, str] | None = None,
        states: set[str] | None = None,
        template: str | None = None,
    ) -> builtins.list[SandboxRecord]:
        return self._table.list(metadata=metadata, states=states, template=template)

    async def create(self, req: CreateRequest, timings: Timings | None = None) -> SandboxRecord:
        return await self._sandboxes.create(req, timings)

    async def kill(self, sandbox_id: str) -> None:
        # Out of standby (frozen tasks die only thawed); one on disk is killed there.
        await self._idle.wake(sandbox_id, restore=False)
        with self._stats.observe("kill", sandbox_id):
            await self._sandboxes.kill(sandbox_id)

    async def set_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord:
        self._idle.touch(sandbox_id)
        return await self._sandboxes.set_timeout(sandbox_id, timeout)

    async def update_network(self, sandbox_id: str, policy: EgressPolicy) -> SandboxRecord:
        return await self._sandboxes.update_network(sandbox_id, policy)

    async def refresh(self, sandbox_id: str, duration: int | None) -> SandboxRecord:
        self._idle.touch(sandbox_id)
        return await self._sandboxes.refresh(sandbox_id, duration)

    async def export_layers(self, sandbox_id: str) -> builtins.list[str]:
        return await self._sandboxes.export_layers(sandbox_id)

    def envd(self, r: SandboxRecord) -> EnvdClient:
        """Process and file calls to a running sandbox's envd, with its access token."""
        if r.address is None:
            raise BadRequest(f"sandbox {r.sandbox_id!r} is not running")
        return self._envd.at(r.address, r.envd_access_token)

    def in_sandbox_python(self) -> tuple[builtins.list[str], dict[str, str]]:
        """argv prefix and environment that run the node's own Python inside a sandbox."""
        return self._bundle.python_args(), self._bundle.python_env()

    # ------------------------------------------------------------------ pause tiers
    async def pause(
        self,
        sandbox_id: str,
        memory: bool = True,
        timings: Timings | None = None,
        *,
        require_healthy_guest: bool = False,
    ) -> None:
        # envd's journal is not read first (a request into the sandbox would cost pause
        # more than the freeze): a frozen or hibernated envd keeps it for the next read
        # after resume; a paused sandbox's logs are those read before it paused.
        # A napping sentry would stop slower; one in standby on disk is paused there.
        await self._idle.wake(sandbox_id, restore=False)
        with self._stats.observe("pause", sandbox_id):
            await self._pauser.pause(
                sandbox_id, memory, timings, require_healthy_guest=require_healthy_guest
            )
        self._logs.note(sandbox_id, "sandbox paused", memory=str(memory).lower())

    async def hibernate(self, sandbox_id: str, timings: Timings | None = None) -> None:
        with self._stats.observe("hibernate", sandbox_id):
            await self._pauser.hibernate(sandbox_id, timings)

    async def connect(
        self,
        sandbox_id: str,
        timeout: int | None,
        memory: bool | None = None,
        timings: Timings | None = None,
    ) -> tuple[SandboxRecord, bool]:
        await self._idle.wake(sandbox_id)
        with self._stats.observe("connect", sandbox_id):
            r, resumed = await self._pauser.connect(sandbox_id, timeout, memory, timings)
        if resumed:
            self._logs.note(sandbox_id, "sandbox resumed")
        return r, resumed

    async def resolve(
        self, sandbox_id: str, port: int, traffic_token: str | None = None
    ) -> Upstream:
        upstream = await self._pauser.resolve(sandbox_id, port, traffic_token)
        await self._idle.wake(sandbox_id)
        return upstream

    async def expose(self, sandbox_id: str, port: int) -> bool:
        """The proxy found `port` refused: asks the sandbox's envd to forward it if a process
        listens on it on loopback only. Whether a retry may now reach it."""
        r = self._table.find(sandbox_id)
        if r is None or r.state is not SandboxState.RUNNING or r.address is None:
            return False
        try:
            return await self._envd.at(r.address, r.envd_access_token).forward(port)
        except (AenvError, httpx.HTTPError, ValueError) as e:
            log.debug("no forward of port %s of %s: %s", port, sandbox_id, e)
            return False

    def signed_by(
        self, path: str, op: str, user: str, signature: str, exp: str | None
    ) -> str | None:
        """The sandbox whose envd token made a signed file URL's signature, if any: such a
        URL made against a node address (`E2B_SANDBOX_URL`) names no sandbox."""
        want = signature.encode()
        for r in self._table.all():
            if r.state in LIVE_STATES and r.envd_access_token:
                mine = file_signature(path, op, user, r.envd_access_token, exp)
                if hmac.compare_digest(mine.encode(), want):
                    return r.sandbox_id
        return None

    def use_quotas(self, quotas: Callable[[str], Quota | None]) -> None:
        """`quotas(key name)`: what an API key's sandboxes may hold (`aenv keys set`); the
        API gives its key store's."""
        self._table.quotas = quotas

    def on_sandbox_stopped(self, listener: Callable[[str], None]) -> None:
        """`listener(sandbox_id)` runs whenever a sandbox's processes end."""
        self._ctx.on_stopped(listener)

    # ------------------------------------------------------------------ snapshots, fork
    async def snapshot(
        self,
        sandbox_id: str,
        name: str | None = None,
        timings: Timings | None = None,
        *,
        template_id: str | None = None,
        parent: str | None = None,
        build: BuildInfo | None = None,
        internal: bool = False,
        memory: bool = True,
    ) -> TemplateRecord:
        await self._idle.wake(sandbox_id)  # a napping sentry would checkpoint slower
        with self._stats.observe("snapshot", sandbox_id):
            rec = await self._snapshotter.snapshot(
                sandbox_id,
                name,
                timings,
                template_id=template_id,
                parent=parent,
                build=build,
                internal=internal,
                memory=memory,
            )
        if not internal:
            self._logs.note(sandbox_id, "snapshot taken", snapshotID=rec.template_id)
        return rec

    async def snapshots(
        self, sandbox_id: str | None = None, name: str | None = None
    ) -> builtins.list[TemplateRecord]:
        return await self._templates.snapshots(sandbox_id, name)

    async def get_snapshot(self, id_or_name: str) -> TemplateRecord:
        """A user's snapshot by id or name (404 for anything else: templates, internal ones)."""
        return await self._templates.get_snapshot(id_or_name)

    async def fork(
        self,
        sandbox_id: str,
        count: int,
        timeout: int | None = None,
        timings: Timings | None = None,
    ) -> builtins.list[ForkResult]:
        await self._idle.wake(sandbox_id)
        with self._stats.observe("fork", sandbox_id):
            children = await self._forker.fork(sandbox_id, count, timeout, timings)
        self._logs.note(sandbox_id, "sandbox forked", count=count)
        return children

    # ------------------------------------------------------------------ observability
    def metrics(
        self, sandbox_id: str, start: datetime | None = None, end: datetime | None = None
    ) -> builtins.list[MetricSample]:
        """The sandbox's recorded samples in [start, end], oldest first."""
        return self._metrics.series(self._table.get(sandbox_id), start, end)

    def latest_metrics(self, sandbox_id: str) -> MetricSample | None:
        r = self._table.find(sandbox_id)
        return None if r is None else self._metrics.latest(r)

    async def logs(self, sandbox_id: str) -> builtins.list[LogEntry]:
        """The sandbox's log entries (envd's journal read first), oldest first."""
        r = self._table.get(sandbox_id)
        await self._idle.wake(sandbox_id)  # envd answers only awake
        await self._logs.pull(r)
        return self._logs.entries(r)

    async def node_info(self, *, with_sandboxes: bool = False) -> NodeInfo:
        return await asyncio.to_thread(self._stats.info, with_sandboxes=with_sandboxes)

    async def prometheus(self) -> bytes:
        """The node's Prometheus text exposition."""
        return await asyncio.to_thread(self._stats.exposition)

    async def sample(self) -> None:
        """One round of the sampler (it runs every few seconds; the tests drive it)."""
        await self._sampler.round()

    # ------------------------------------------------------------------ cluster moves
    async def drain(self) -> builtins.list[DrainResult]:
        return await self._mover.drain()

    def undrain(self) -> None:
        self._mover.undrain()

    async def release(self, sandbox_id: str) -> str:
        return await self._mover.release(sandbox_id)

    async def adopt(self, sandbox_id: str, image: str) -> SandboxRecord:
        return await self._mover.adopt(sandbox_id, image)

    # ------------------------------------------------------------------ templates
    async def template(self, id_or_name: str) -> TemplateRecord:
        return await self._templates.get(id_or_name)

    async def find_template(self, id_or_name: str) -> TemplateRecord | None:
        return await self._templates.find(id_or_name)

    async def templates(self) -> builtins.list[TemplateRecord]:
        """Every template, internal ones included."""
        return await self._templates.all()

    async def register_template(
        self, rec: TemplateRecord, *, publish: bool = True, exact_names: bool = False
    ) -> None:
        """Adds or replaces a template (see TemplateRegistry.register)."""
        await self._templates.register(rec, publish=publish, exact_names=exact_names)

    async def set_template_standby(self, id_or_name: str, seconds: float | None) -> TemplateRecord:
        """Seconds idle before standby for the template's new sandboxes that set none
        (None: the node's `AENV_STANDBY_AFTER`; 0: never)."""
        rec = await self._templates.get(id_or_name)
        rec.standby_after = seconds
        await self._templates.update(rec)
        return rec

    async def delete_template(self, template_id: str) -> None:
        rec = await self._templates.get(template_id)
        if rec.template_id == DEFAULT_TEMPLATE:
            raise BadRequest(f"the default template {DEFAULT_TEMPLATE!r} cannot be deleted")
        await self._boot_snapshots.forget_template(rec.template_id)
        await self._templates.delete(rec)

    # ------------------------------------------------------------------ volumes
    async def create_volume(self, name: str) -> VolumeRecord:
        return await asyncio.to_thread(self._volumes.create, name)

    async def volumes(self) -> builtins.list[VolumeRecord]:
        return await asyncio.to_thread(self._volumes.all)

    async def volume(self, volume_id: str) -> VolumeRecord:
        return await asyncio.to_thread(self._volumes.get, volume_id)

    async def delete_volume(self, volume_id: str) -> None:
        """Refused (409) while a sandbox of this node that is not gone mounts it (paused
        ones remount it at resume); snapshots only name it, and fail to start once it is
        gone."""
        rec = await self.volume(volume_id)
        users = sorted(
            r.sandbox_id
            for r in self._table.all()
            if r.state not in _ENDED and any(m.volume_id == rec.volume_id for m in r.volume_mounts)
        )
        if users:
            raise Conflict(
                f"volume {rec.name!r} is mounted by sandbox(es) {', '.join(users)}: kill them first"
            )
        await asyncio.to_thread(self._volumes.delete, volume_id)

    async def volume_files(self, volume_id: str, token: str) -> VolumeFiles:
        """The files of a volume, for the holder of its token."""
        rec = await asyncio.to_thread(self._volumes.authorize, volume_id, token)
        return VolumeFiles(await asyncio.to_thread(self._volumes.data_dir, rec.volume_id))

    # ------------------------------------------------------------------ layers
    def layer_path(self, digest: str) -> Path:
        return self._storage.layers.path(digest)

    def has_layer(self, digest: str) -> bool:
        return self._storage.layers.has(digest)

    async def hold_layers(self, kind: str, ident: str, digests: builtins.list[str]) -> None:
        """Keeps layers from eviction on behalf of `kind`/`ident` (a build, a pull...)."""
        await asyncio.to_thread(self._storage.hold, kind, ident, digests)

    async def release_layers(self, kind: str, ident: str) -> None:
        await asyncio.to_thread(self._storage.release, kind, ident)

    async def pull_image(self, image: str, **kw: Any) -> PulledImage:
        """Pulls an OCI image into the node's layer store (see images.pull.pull); `pin`
        (kind, ident) holds its layers until `release_layers(kind, ident)`."""
        pin = kw.pop("pin", None)
        return await pull(
            self.settings.images,
            self._storage.layers,
            image,
            cache=self._storage.refs,
            holder=None if pin is None else holder(*pin),
            **kw,
        )
