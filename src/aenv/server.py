"""The node process: builds the parts once from Settings and serves them with uvicorn."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import sys

import uvicorn
from starlette.types import ASGIApp

from .config import Settings
from .errors import AenvError
from .fsutil import private_tree
from .logctx import configure as configure_logging
from .orchestrator import Orchestrator
from .orchestrator.catalog import Catalog
from .orchestrator.durable import Durable
from .orchestrator.storage import SandboxStorage
from .runtime import priority
from .snapshots import SnapshotStore, open_repository

log = logging.getLogger("aenv.server")


def prepare_home(settings: Settings) -> None:
    """Nothing in the home is for other host users: 0700 with its state directories, its
    files 0600 (a home made by an older aenv is tightened)."""
    private_tree(settings.home, whole=(settings.secrets_dir.name,))


def build_orchestrator(settings: Settings) -> Orchestrator:
    from .images.layers import LayerStore
    from .runtime.bundle import ensure_bundle
    from .runtime.cowpool import open_pool
    from .runtime.gvisor import GVisorRuntime

    prepare_home(settings)
    catalog = Catalog(settings.catalog_path)
    pool = open_pool(settings)  # before the layer store: it may mount layers/
    layers = LayerStore(settings)
    bundle = ensure_bundle(settings)
    runtime = GVisorRuntime(settings)
    storage = SandboxStorage(settings, layers, pool)
    repo = open_repository(settings.snapshots, settings.repo_dir)
    durable = Durable(
        SnapshotStore(settings.snapshots, repo, layers, cache_dir=settings.cache_dir),
        catalog,
        storage,
        runtime.image_complete,
    )
    return Orchestrator(settings, catalog, runtime, storage=storage, bundle=bundle, durable=durable)


def check_tls(settings: Settings) -> None:
    """Loads the certificate and key once now, so a wrong path or a key that does not fit
    the certificate is one clear line at start-up, not a traceback from uvicorn."""
    if settings.tls_cert is None or settings.tls_key is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            settings.tls_cert, settings.tls_key
        )
    except (OSError, ssl.SSLError) as exc:
        raise AenvError(
            f"cannot use AENV_TLS_CERT={settings.tls_cert} with AENV_TLS_KEY={settings.tls_key}: "
            f"{getattr(exc, 'strerror', None) or exc}"
        ) from None


def serve(settings: Settings) -> None:
    from .api.app import create_app

    configure_logging(settings.log_format)
    # Every envd health probe would be an INFO line.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    check_tls(settings)
    priority.raise_node()  # before any thread: they inherit it
    # Worker threads (file copies, checkpoints) hand the GIL back to the event loop sooner:
    # a request waits on it at most ~1 ms a switch instead of 5.
    sys.setswitchinterval(0.001)
    orch = build_orchestrator(settings)
    app = create_app(settings, orch)
    print(f"aenv: serving on {settings.url} (home {settings.home})", file=sys.stderr)
    QuietServer(uvicorn_config(app, settings)).run()


def watch_children_by_pidfd() -> None:
    """Has asyncio wait for its child processes (runsc commands) through pidfds on the
    running loop, as Python 3.12 does by default, instead of 3.11's thread per child: each
    command's start cost the loop a thread start and GIL hand-offs (seen in a profile under
    rollouts). Left as it is where the kernel or Python lacks pidfds."""
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return
    watcher = asyncio.PidfdChildWatcher()
    watcher.attach_loop(asyncio.get_running_loop())
    asyncio.set_child_watcher(watcher)


class QuietServer(uvicorn.Server):
    """uvicorn, waking once a second instead of ten times to see whether to stop: an idle
    node's own CPU is a cost per node (a stop is noticed within a second)."""

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        watch_children_by_pidfd()
        await super().serve(sockets)

    async def main_loop(self) -> None:
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000  # on_tick's once-a-second work, every tick
            await asyncio.sleep(1.0)
            should_exit = await self.on_tick(counter)


def uvicorn_config(app: ASGIApp, settings: Settings) -> uvicorn.Config:
    """How a node and a gateway serve their one port."""
    from .proxy.ws import SERVER_OPTIONS as WS_SERVER_OPTIONS

    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_keep_alive=75,
        # The proxy passes the sandbox's own headers through; uvicorn must not add a second set.
        server_header=False,
        date_header=False,
        ssl_certfile=settings.tls_cert,
        ssl_keyfile=settings.tls_key,
        **WS_SERVER_OPTIONS,
    )
