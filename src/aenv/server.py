"""The composition root: the one place where a process is built from its Settings.

A node: Settings → runtime (`AENV_RUNTIME`) → stores → orchestrator → builder, API keys and
(in a cluster) the agent → the app, with one lifespan that starts those parts in that order
and closes them in reverse. A gateway: Settings → cluster state, scheduler, directory, node
client → the gateway app, likewise. `serve`/`serve_gateway` run them on uvicorn.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

from starlette.middleware import Middleware
from starlette.types import ASGIApp

from .api.app import create_app
from .api.requestid import RequestId
from .builds.builder import Builder
from .cluster.agent import NodeAgent
from .cluster.directory import Directory, Discover
from .cluster.endpoints import EndpointWatch
from .cluster.forward import NodeClient
from .cluster.gateway import Gateway, create_gateway_app
from .cluster.k8s import KubernetesDiscovery
from .cluster.lostsweep import LostSweep
from .cluster.metrics import GatewayMetrics
from .cluster.scheduler import load_scheduler
from .cluster.state import ClusterState
from .config import Settings
from .errors import AenvError
from .fsutil import private_tree
from .images.layers import LayerStore
from .keys import KeyStore
from .logctx import configure as configure_logging
from .orchestrator import Orchestrator
from .orchestrator.catalog import Catalog
from .orchestrator.durable import Durable
from .orchestrator.storage import SandboxStorage
from .proxy.ws import SERVER_OPTIONS as WS_SERVER_OPTIONS
from .redact import url_without_password
from .runtime import priority
from .runtime.base import Runtime
from .runtime.bundle_build import ensure_bundle
from .runtime.select import make_runtime
from .runtime.storage.cowpool import open_pool
from .secretstore import SecretStore
from .serving import Part, Parts, QuietServer, check_tls, uvicorn_config
from .snapshots import SnapshotStore, open_repository
from .telemetry import HttpMetricsMiddleware, MetricsListener

log = logging.getLogger("aenv.server")


def prepare_home(settings: Settings) -> None:
    """Nothing in the home is for other host users: 0700 with its state directories, its
    files 0600 (a home made by an older aenv is tightened)."""
    private_tree(settings.home, whole=(settings.secrets_dir.name,))


def build_orchestrator(settings: Settings, runtime: Runtime | None = None) -> Orchestrator:
    """The node's orchestrator over its stores and the runtime `settings.runtime` names
    (or `runtime`, already built)."""
    prepare_home(settings)
    catalog = Catalog(settings.catalog_path)
    pool = open_pool(settings)  # before the layer store: it may mount layers/
    layers = LayerStore(settings)
    bundle = ensure_bundle(settings)
    runtime = runtime or make_runtime(settings)
    storage = SandboxStorage(settings, layers, pool)
    repo = open_repository(settings.snapshots, settings.repo_dir)
    durable = Durable(
        SnapshotStore(settings.snapshots, repo, layers, cache_dir=settings.cache_dir),
        catalog,
        storage,
        runtime.image_complete,
    )
    return Orchestrator(settings, catalog, runtime, storage=storage, bundle=bundle, durable=durable)


class _KeyBootstrap:
    """Makes the first API key of a fresh home (printed once) before the node serves."""

    def __init__(self, settings: Settings, keys: KeyStore) -> None:
        self.settings, self.keys = settings, keys

    async def start(self) -> None:
        fresh = self.keys.bootstrap(generate=not self.settings.api_key)
        if fresh:
            print(
                f"aenv: generated API key 'default' (also in {self.settings.api_key_file}):"
                f"\n  {fresh}",
                file=sys.stderr,
            )

    async def close(self) -> None:
        return None


@dataclass(frozen=True)
class Served:
    """An ASGI app and the parts behind its lifespan (the server calls their `stopping`)."""

    app: ASGIApp
    parts: Parts


def node_served(settings: Settings, orchestrator: Orchestrator | None = None) -> Served:
    """The node's one ASGI app and its parts (`orchestrator`: one already built, as tests
    give one over the fake runtime)."""
    orch = orchestrator if orchestrator is not None else build_orchestrator(settings)
    keys = KeyStore.of(settings)
    orch.table.quotas = keys.quota_of  # what each API key's sandboxes may hold
    secrets = SecretStore.of(settings)
    orch.use_secrets(secrets.lookup)  # read by the egress proxy only
    builder = Builder(settings, orch)
    parts: list[Part] = [_KeyBootstrap(settings, keys), orch, builder]
    if settings.redis_url:
        parts.append(NodeAgent(settings, orch, ClusterState(settings.redis_url), secrets))
    if settings.metrics_listen:
        parts.append(MetricsListener(settings.metrics_listen, orch.stats.exposition))
    lifespan = Parts(*parts)
    app = create_app(settings, orch, keys=keys, builder=builder, secrets=secrets, lifespan=lifespan)
    # Outside the data-plane router: sandbox traffic is counted too (as `data-plane`).
    return Served(HttpMetricsMiddleware(app, orch.stats.http), lifespan)


def node_app(settings: Settings, orchestrator: Orchestrator | None = None) -> ASGIApp:
    return node_served(settings, orchestrator).app


@dataclass
class _Closing:
    """A part with nothing to start (its connections open on first use)."""

    closer: Callable[[], Awaitable[None]]

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        await self.closer()


def gateway_app(settings: Settings) -> ASGIApp:
    """The gateway's one ASGI app over the cluster's Redis (`AENV_REDIS_URL`)."""
    if not settings.redis_url:
        raise AenvError("aenv gateway needs AENV_REDIS_URL (the cluster's Redis)")
    state = ClusterState(settings.redis_url)
    scheduler = load_scheduler(settings.scheduler)
    parts: list[Part] = []
    discover: Discover | None = None
    if settings.discovery == "kubernetes":
        k8s = KubernetesDiscovery(settings.kubernetes_service, settings.kubernetes_namespace)
        watch = EndpointWatch(k8s)
        parts.append(watch)
        discover = watch.ready
    directory = Directory(settings, state, scheduler, discover)
    metrics = GatewayMetrics()
    nodes = NodeClient(metrics)
    gateway = Gateway(settings, state, directory, nodes, scheduler, metrics)
    if settings.metrics_listen:
        parts.append(
            MetricsListener(settings.metrics_listen, partial(metrics.exposition, directory.nodes))
        )
    parts.append(LostSweep(settings, state, gateway.events))
    lifespan = Parts(*parts, _Closing(nodes.aclose), _Closing(state.close))
    # The node API's request ids: the gateway's answers carry one too, and it goes on to
    # the node with the request (the node keeps a usable id it is given).
    ids = [Middleware(RequestId, access_log=settings.access_log)]
    app = create_gateway_app(settings, gateway, directory, lifespan, ids)
    return HttpMetricsMiddleware(app, metrics.http)


def _serving(settings: Settings) -> None:
    configure_logging(settings.log_format)
    # Every envd health probe would be an INFO line.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    check_tls(settings)


def serve(settings: Settings) -> None:
    _serving(settings)
    priority.raise_node()  # before any thread: they inherit it
    # Worker threads (file copies, checkpoints) hand the GIL back to the event loop sooner:
    # a request waits on it at most ~1 ms a switch instead of 5.
    sys.setswitchinterval(0.001)
    served = node_served(settings)
    # A log line, not a print: with AENV_LOG_FORMAT=json every line of stderr is JSON.
    log.info("serving on %s (home %s)", settings.url, settings.home)
    config = uvicorn_config(served.app, settings, WS_SERVER_OPTIONS)
    QuietServer(config, served.parts.stopping).run()


def serve_gateway(settings: Settings) -> None:
    _serving(settings)
    app = gateway_app(settings)
    log.info(
        "gateway serving on %s (cluster %s)",
        settings.url,
        url_without_password(settings.redis_url or ""),
    )
    QuietServer(uvicorn_config(app, settings, WS_SERVER_OPTIONS)).run()
