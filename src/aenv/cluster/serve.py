"""The gateway process: one Settings, the gateway app, uvicorn."""

from __future__ import annotations

import logging
import sys

from ..config import Settings
from ..logctx import configure as configure_logging
from ..proxy.ws import SERVER_OPTIONS as WS_SERVER_OPTIONS
from ..serving import QuietServer, check_tls, uvicorn_config
from .gateway import create_gateway_app


def serve_gateway(settings: Settings) -> None:
    configure_logging(settings.log_format)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    check_tls(settings)
    app = create_gateway_app(settings)
    print(
        f"aenv: gateway serving on {settings.url} (cluster {settings.redis_url})", file=sys.stderr
    )
    QuietServer(uvicorn_config(app, settings, WS_SERVER_OPTIONS)).run()
