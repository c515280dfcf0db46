"""What nodes and gateways alike tell Prometheus: HTTP requests by route template, the
process (CPU, memory, file descriptors), the build, and the optional listener that serves
`/metrics` without an API key (`AENV_METRICS_LISTEN`), as exporters usually do.

Names follow Prometheus's conventions: base units (seconds, bytes), counters end in
`_total` (prometheus_client adds it to a Counter's name), `_info` gauges are 1 and carry
their facts as labels."""

from __future__ import annotations

import asyncio
import contextlib
import platform
import socket
import time
from collections.abc import Awaitable, Callable, Generator

import uvicorn
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import __version__
from .errors import AenvError
from .serving import QuietServer

# Set in an HTTP request's scope by whatever routes it, when the framework's own route
# (Starlette's `scope["route"]`) is not the one to report: the gateway, whose one catch-all
# route takes every path, and a node's data plane.
ROUTE_KEY = "aenv.route"
DATA_PLANE = "data-plane"
# A request no route took (a 404 of the router itself): one label for all such paths, so a
# scanner's random paths do not make a series each.
UNMATCHED = "unmatched"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# From a health check's milliseconds to a build's upload or a fork of many children.
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

Exposition = Callable[[], Awaitable[bytes]]


def set_route(scope: Scope, template: str) -> None:
    """The request is reported under `template` (a route template such as
    `/sandboxes/{sandbox_id}`, never a path with ids in it)."""
    scope[ROUTE_KEY] = template


def route_of(scope: Scope) -> str:
    given = scope.get(ROUTE_KEY)
    if isinstance(given, str):
        return given
    # Starlette puts the route that took the request in the scope (in place, so the
    # middleware outside sees it once the app returns).
    fmt = getattr(scope.get("route"), "path_format", None)
    return fmt if isinstance(fmt, str) else UNMATCHED


class HttpMetrics:
    """`aenv_http_requests_total{method,route,status}` and
    `aenv_http_request_duration_seconds{method,route}` in `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "aenv_http_requests",
            "HTTP requests answered, by method, route template and status code",
            ["method", "route", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            "aenv_http_request_duration_seconds",
            "Time from a request's arrival to the end of its answer (a stream's whole life)",
            ["method", "route"],
            buckets=HTTP_BUCKETS,
            registry=registry,
        )

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        # Methods outside HTTP's usual ones are one label, like unmatched paths.
        m = method if method in _METHODS else "other"
        self.requests.labels(m, route, str(status)).inc()
        self.duration.labels(m, route).observe(seconds)


class HttpMetricsMiddleware:
    """Counts and times every HTTP request of `app` (WebSockets and the lifespan pass)."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        # What the server answers when the app raises before any answer.
        status = 500

        async def send_seen(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        # The proxy resets a client's connection through the server's `send` (a sandbox
        # gone mid-stream): functools' marker lets it find that behind this wrapper.
        send_seen.__wrapped__ = send  # type: ignore[attr-defined]
        try:
            await self.app(scope, receive, send_seen)
        finally:
            self.metrics.observe(
                scope["method"], route_of(scope), status, time.perf_counter() - start
            )


def register_process_and_build(registry: CollectorRegistry) -> None:
    """The process's own families (`process_cpu_seconds_total`,
    `process_resident_memory_bytes`, open fds..., Python's GC and `python_info`) and
    `aenv_build_info{version,python}` in `registry` (a process's own registry, not the
    library's global one)."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    Gauge(
        "aenv_build_info",
        "The aenv version and Python version of this process (always 1)",
        ["version", "python"],
        registry=registry,
    ).labels(__version__, platform.python_version()).set(1)


def metrics_app(exposition: Exposition) -> ASGIApp:
    """An ASGI app with one route, `GET /metrics`, and no authentication."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # no lifespan to run, no websockets to take
        if scope["path"] != "/metrics":
            status, ctype, body = 404, b"text/plain", b"only /metrics here\n"
        elif scope["method"] not in ("GET", "HEAD"):
            status, ctype, body = 405, b"text/plain", b"GET /metrics\n"
        else:
            status, ctype, body = 200, CONTENT_TYPE_LATEST.encode(), await exposition()
        headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body}
        )

    return app


class _EmbeddedServer(QuietServer):
    """uvicorn beside the process's main server: the main one owns SIGTERM and SIGINT
    (uvicorn's own capture would take them from it, and the process would not stop)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        # Not QuietServer's: the main server already set the loop's child watcher up.
        await uvicorn.Server.serve(self, sockets)


class MetricsListener:
    """A part of a node's or gateway's lifespan: `/metrics` on `listen` (`host:port`)
    without a key, for a Prometheus that scrapes pods directly. Plain HTTP: a network
    policy, not TLS, decides who reaches it."""

    def __init__(self, listen: str, exposition: Exposition) -> None:
        self.listen = listen
        self.exposition = exposition
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        host, _, port = self.listen.rpartition(":")
        host = host.strip("[]") or "0.0.0.0"
        try:
            # Bound here, so a port in use is one clear line at start-up.
            sock = socket.create_server((host, int(port)), reuse_port=False)
        except (OSError, ValueError) as e:
            raise AenvError(f"cannot listen on AENV_METRICS_LISTEN={self.listen}: {e}") from None
        config = uvicorn.Config(
            metrics_app(self.exposition),
            log_level="warning",
            log_config=None,
            access_log=False,
            lifespan="off",
            server_header=False,
        )
        self._server = server = _EmbeddedServer(config)
        self._task = asyncio.create_task(server.serve([sock]), name="aenv-metrics-listener")
        ready = asyncio.create_task(server.ready.wait())
        await asyncio.wait((ready, self._task), return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if self._task.done():
            sock.close()
            # uvicorn ends with SystemExit when its start-up fails.
            error = None if self._task.cancelled() else self._task.exception()
            raise AenvError(f"the metrics listener on {self.listen} did not start: {error!r}")

    async def close(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        # QuietServer looks once a second; a scrape in flight gets its answer first.
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await asyncio.wait_for(self._task, timeout=10)
        self._server = self._task = None
