"""The node process: builds the parts once from Settings and serves them with uvicorn."""

from __future__ import annotations

import logging
import sys

from .api.app import create_app
from .config import Settings
from .fsutil import private_tree
from .images.layers import LayerStore
from .logctx import configure as configure_logging
from .orchestrator import Orchestrator
from .orchestrator.catalog import Catalog
from .orchestrator.durable import Durable
from .orchestrator.storage import SandboxStorage
from .proxy.ws import SERVER_OPTIONS as WS_SERVER_OPTIONS
from .runtime import priority
from .runtime.bundle_build import ensure_bundle
from .runtime.select import make_runtime
from .runtime.storage.cowpool import open_pool
from .serving import QuietServer, check_tls, uvicorn_config
from .snapshots import SnapshotStore, open_repository

log = logging.getLogger("aenv.server")


def prepare_home(settings: Settings) -> None:
    """Nothing in the home is for other host users: 0700 with its state directories, its
    files 0600 (a home made by an older aenv is tightened)."""
    private_tree(settings.home, whole=(settings.secrets_dir.name,))


def build_orchestrator(settings: Settings) -> Orchestrator:
    prepare_home(settings)
    catalog = Catalog(settings.catalog_path)
    pool = open_pool(settings)  # before the layer store: it may mount layers/
    layers = LayerStore(settings)
    bundle = ensure_bundle(settings)
    runtime = make_runtime(settings)
    storage = SandboxStorage(settings, layers, pool)
    repo = open_repository(settings.snapshots, settings.repo_dir)
    durable = Durable(
        SnapshotStore(settings.snapshots, repo, layers, cache_dir=settings.cache_dir),
        catalog,
        storage,
        runtime.image_complete,
    )
    return Orchestrator(settings, catalog, runtime, storage=storage, bundle=bundle, durable=durable)


def serve(settings: Settings) -> None:
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
    QuietServer(uvicorn_config(app, settings, WS_SERVER_OPTIONS)).run()
