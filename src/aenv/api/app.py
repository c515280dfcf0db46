"""The app factory: the control-plane FastAPI app, wrapped by the data-plane router.

`create_app` is the one place where the two planes are composed onto the single port:
requests carrying `E2b-Sandbox-Id` (or a `Host: {port}-{id}.{domain}`) go to sandboxes,
everything else to the control app built by `create_control_app`.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.types import ASGIApp

from aenv import __version__
from aenv.builds.builder import Builder
from aenv.config import Settings
from aenv.console import install_console
from aenv.keys import KeyStore
from aenv.orchestrator import Orchestrator
from aenv.proxy.dispatch import SandboxRouter
from aenv.secretstore import SecretStore
from aenv.serving import Lifespan

from .errors import install_error_handlers
from .idempotency import IdempotencyCache
from .limits import BodyLimit
from .requestid import RequestId
from .routes import (
    builds,
    bulk,
    cluster,
    docs,
    events,
    forktree,
    health,
    images,
    lineage,
    observability,
    sandboxes,
    snapshots,
    tags,
    volumes,
)
from .routes import secrets as secrets_routes


def create_control_app(
    settings: Settings,
    orchestrator: Orchestrator,
    *,
    keys: KeyStore,
    builder: Builder,
    secrets: SecretStore,
    lifespan: Lifespan | None = None,
) -> FastAPI:
    """The E2B control plane alone (no data-plane routing) over the node's parts;
    `lifespan` starts and closes them (`aenv.server` builds both)."""
    app = FastAPI(
        title="aenv",
        version=__version__,
        description="E2B-compatible control plane for gVisor sandboxes.",
        openapi_url="/openapi.json",
        # Its own /docs (routes/docs.py: no CDN); no ReDoc page.
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.orchestrator = orchestrator
    app.state.idempotency = IdempotencyCache()
    app.state.api_keys = keys
    app.state.secrets = secrets
    install_error_handlers(app)
    # Build contexts and volume files stream to disk; every other body is small JSON.
    app.add_middleware(
        BodyLimit, exempt=lambda path: path.startswith(("/build-files/", "/volumecontent/"))
    )
    # Outermost: the id is on every answer, the body limit's 413 included.
    app.add_middleware(RequestId, access_log=settings.access_log)
    app.include_router(health.router)
    app.include_router(docs.router)
    # Before sandboxes: its `/sandboxes/{id}` would take `/sandboxes/metrics`.
    app.include_router(observability.router)
    # Before sandboxes, for clarity: `/sandboxes/pause` and `/sandboxes/timeout` are bulk
    # (no sandbox route has that shape, but an id-shaped segment is easy to misread).
    app.include_router(bulk.router)
    app.include_router(sandboxes.router)
    app.include_router(lineage.router)
    app.include_router(forktree.router)
    builds.attach(app, builder)  # template builds; before snapshots (its /templates/{id:path})
    app.include_router(tags.router)  # likewise
    app.include_router(images.router)
    app.include_router(snapshots.router)
    app.include_router(volumes.router)
    app.include_router(volumes.content_router)
    app.include_router(secrets_routes.router)
    app.include_router(cluster.router)
    app.include_router(events.router)
    install_console(app)  # the web console at /console/ (public page, API calls keyed)
    return app


def create_app(
    settings: Settings,
    orchestrator: Orchestrator,
    *,
    keys: KeyStore,
    builder: Builder,
    secrets: SecretStore,
    lifespan: Lifespan | None = None,
) -> ASGIApp:
    """The node's single ASGI app: data plane in front of the control plane."""
    control = create_control_app(
        settings, orchestrator, keys=keys, builder=builder, secrets=secrets, lifespan=lifespan
    )
    router = SandboxRouter(
        control,
        orchestrator.pauser.resolve,
        settings.routing_domains,
        signed_by=orchestrator.signed_by,
        expose=orchestrator.expose,
    )
    orchestrator.context.on_stopped(router.drop)
    return router
