"""The one-port front: data-plane requests go to sandboxes, everything else to the control app.

A request (HTTP or WebSocket) is data plane when

1. it carries `E2b-Sandbox-Id` or `x-agentenv-sandbox-id` (port from `x-agentenv-target-port`
   or `E2b-Sandbox-Port`, default 49983, envd). AgentENV's `/proxy` prefix is removed from
   such requests (`/proxy/health` → `/health`), so `E2B_SANDBOX_URL=http://host:port/proxy`
   works too; or
2. its `Host` is `{port}-{sandboxID}.{domain}` for a configured domain (path unchanged); or
3. it is a signed file URL (`/files?…&signature=…`) with neither: it goes to envd in the
   sandbox whose envd token made the signature (`signed_by`).

A `/proxy` path without a sandbox header is a 400; anything else (and lifespan) goes to the
control app. The routing headers and the traffic token are removed before forwarding;
hop-by-hop headers are the only others touched. `Host` is passed unchanged unless the sandbox
has a host mask: an app in the sandbox sees the name the client used (`3000-<id>.<domain>`),
as behind E2B's own edge, so the absolute URLs, redirects, cookies and host checks it makes
are about the address the user reaches it by.

envd's internal routes are refused (403). The resolver gets the client's
`e2b-traffic-access-token` and decides (a private sandbox's ports want it: 403 otherwise).

Resolver errors keep their status and `{code, message}` body. As behind E2B's edge, a sandbox
that is unknown, gone or paused without auto-resume is a 502 "The sandbox was not found" and
a port nobody listens on a 502 "The sandbox is running but port is not open" (the SDKs read the
first from envd's `/health` as "not running"); a failed auto-resume is a 502, a timed-out one
504. `drop(sandbox_id)` (the node calls it when a sandbox's processes end) breaks off the
requests and WebSockets in flight to it, so their clients learn at once.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import parse_qs, quote

from aenv.domain import ENVD_PORT, Upstream
from aenv.errors import (
    AenvError,
    BadRequest,
    Forbidden,
    GatewayTimeout,
    InternalError,
    Unauthorized,
)
from aenv.logctx import sandbox_context
from aenv.telemetry import DATA_PLANE, set_route

from ._common import (
    ROUTING_HEADERS,
    ASGIApp,
    Exposer,
    Message,
    Receive,
    Scope,
    Send,
    Target,
    deny_websocket_json,
    send_json,
)
from .http import HttpForwarder
from .ws import WebSocketForwarder

log = logging.getLogger(__name__)

DEFAULT_PORT = ENVD_PORT
# envd routes only the node calls, refused from outside as E2B's proxy does: `/init` re-keys
# a sandbox (token, environment, user), `/envs`, `/metrics` and `/logs` read its state,
# `/forward` opens a port forward, `/oom` kills the sandbox's largest process.
INTERNAL_ENVD_PATHS = frozenset({"/init", "/envs", "/metrics", "/logs", "/forward", "/oom"})
# (sandbox id, port, the client's traffic token or None) -> where to send the request.
Resolver = Callable[[str, int, str | None], Awaitable[Upstream]]
# (path, "read"|"write", username, signature, expiration or None) -> the sandbox that signed.
# Awaited: a gateway asks its nodes, which hold the sandboxes' tokens.
SignatureResolver = Callable[[str, str, str, str, str | None], Awaitable[str | None]]
TRAFFIC_TOKEN_HEADER = b"e2b-traffic-access-token"

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_MAX_LABEL = 63


@dataclass(frozen=True, slots=True)
class Route:
    sandbox_id: str
    port: int
    strip_proxy_prefix: bool = False


def _sandbox_id(raw: str) -> str:
    if not _ID_RE.fullmatch(raw):
        raise BadRequest(f"invalid sandbox id {raw[:80]!r}")
    return raw


def _port(raw: str) -> int:
    raw = raw.strip()
    if not (raw.isascii() and raw.isdigit()) or not 0 < int(raw) < 65536:
        raise BadRequest(f"invalid sandbox port {raw[:16]!r}")
    return int(raw)


def _traffic_token(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == TRAFFIC_TOKEN_HEADER:
            return str(value.decode("latin-1"))
    return None


def _forwarded_headers(
    headers: list[tuple[bytes, bytes]], host_header: str | None
) -> list[tuple[bytes, bytes]]:
    """The client's headers without the routing ones and the traffic token (the sandbox's
    app never sees it), the Host replaced by the sandbox's mask if it has one."""
    out = [(n, v) for n, v in headers if n not in ROUTING_HEADERS and n != TRAFFIC_TOKEN_HEADER]
    if host_header is not None:
        out = [(n, v) for n, v in out if n != b"host"]
        out.insert(0, (b"host", host_header.encode("latin-1")))
    return out


def _internal(path: str, strip_proxy_prefix: bool) -> bool:
    """Whether a (decoded) request path names one of envd's internal routes, however it is
    spelled (`//init/`, `/proxy/init` with the prefix)."""
    if strip_proxy_prefix:
        path = path[len("/proxy") :]
    return "/" + "/".join(p for p in path.split("/") if p) in INTERNAL_ENVD_PATHS


def _has_proxy_prefix(path: str | bytes) -> bool:
    if isinstance(path, str):
        return path == "/proxy" or path.startswith("/proxy/")
    return path == b"/proxy" or path.startswith(b"/proxy/")


class SandboxRouter:
    """ASGI app: `SandboxRouter(control_app, resolver, domains)`."""

    def __init__(
        self,
        control_app: ASGIApp,
        resolver: Resolver,
        domains: list[str],
        *,
        default_port: int = DEFAULT_PORT,
        connect_timeout: float = 5.0,
        http: HttpForwarder | None = None,
        ws: WebSocketForwarder | None = None,
        signed_by: SignatureResolver | None = None,
        expose: Exposer | None = None,
    ) -> None:
        self.control_app = control_app
        self.resolver = resolver
        self.signed_by = signed_by
        self.domains = [d.strip().strip(".").lower() for d in domains if d.strip().strip(".")]
        self.default_port = default_port
        self.http = http or HttpForwarder(connect_timeout=connect_timeout, expose=expose)
        self.ws = ws or WebSocketForwarder(connect_timeout=connect_timeout, expose=expose)

    # -- routing -----------------------------------------------------------------------

    def route(self, scope: Scope) -> Route | None:
        """The sandbox and port a request is for, None for the control plane.

        Raises BadRequest for malformed routing information."""
        sid = e2b_sid = port = e2b_port = host = None
        for name, value in scope["headers"]:
            if name == b"x-agentenv-sandbox-id":
                sid = value
            elif name == b"e2b-sandbox-id":
                e2b_sid = value
            elif name == b"x-agentenv-target-port":
                port = value
            elif name == b"e2b-sandbox-port":
                e2b_port = value
            elif name == b"host":
                host = value
        sid = sid if sid is not None else e2b_sid
        if sid is not None:
            port = port if port is not None else e2b_port
            raw_path = scope.get("raw_path") or scope["path"].encode()
            return Route(
                _sandbox_id(sid.decode("latin-1").strip()),
                self.default_port if port is None else _port(port.decode("latin-1")),
                _has_proxy_prefix(raw_path),
            )
        if host is not None and self.domains:
            found = self._host_route(host.decode("latin-1"))
            if found is not None:
                return found
        if self._signed(scope):
            return None  # resolved by `find_route`, which may wait for the signer
        if _has_proxy_prefix(scope["path"]):
            raise BadRequest(
                "missing sandbox routing header (e2b-sandbox-id or x-agentenv-sandbox-id)"
            )
        return None

    def _host_route(self, host: str) -> Route | None:
        host = host.strip()
        if host.startswith("["):
            return None  # an IPv6 literal is never a sandbox host
        name, sep, port = host.rpartition(":")
        if sep and port.isascii() and port.isdigit():
            host = name
        host = host.rstrip(".")
        lower = host.lower()
        for domain in self.domains:
            if not lower.endswith(domain) or lower[-len(domain) - 1 : -len(domain)] != ".":
                continue
            label = host[: -len(domain) - 1]  # the sandbox id keeps its case
            port_text, dash, sandbox = label.partition("-")
            if "." in label or not dash or not (port_text.isascii() and port_text.isdigit()):
                continue  # some other name under the domain
            if len(label) > _MAX_LABEL:
                raise BadRequest(f"sandbox host label longer than {_MAX_LABEL} characters")
            return Route(_sandbox_id(sandbox), _port(port_text))
        return None

    async def find_route(self, scope: Scope) -> Route | None:
        """`route`, and for a signed file URL the sandbox that signed it."""
        found = self.route(scope)
        if found is None and self._signed(scope):
            return await self._signed_route(scope)
        return found

    def _signed(self, scope: Scope) -> bool:
        """Whether the request is a signed file URL that names no sandbox (headers and host
        name none: `route` looked at them first)."""
        if self.signed_by is None or scope["path"] not in ("/files", "/proxy/files"):
            return False
        if scope.get("method") not in ("GET", "POST"):
            return False
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        return bool(query.get("signature", [""])[0])

    async def _signed_route(self, scope: Scope) -> Route:
        """A signed file URL made against the node's own address (E2B_SANDBOX_URL) names no
        sandbox: the sandbox whose token signed it is the one. A signature no sandbox made is
        refused as envd refuses a bad one (401)."""
        assert self.signed_by is not None
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        signature = query["signature"][0]
        expiration = query.get("signature_expiration", [None])[0]
        sandbox_id = await self.signed_by(
            query.get("path", [""])[0],
            "read" if scope["method"] == "GET" else "write",
            query.get("username", [""])[0],
            signature,
            expiration,
        )
        if sandbox_id is None:
            raise Unauthorized("invalid signature")
        return Route(sandbox_id, ENVD_PORT, scope["path"] == "/proxy/files")

    # -- ASGI --------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http" or kind == "websocket":
            try:
                route = await self.find_route(scope)
            except AenvError as exc:
                await self._error(scope, send, exc.status, exc.to_json())
                return
            if route is not None:
                # One label for all sandbox traffic (`aenv_http_requests_total`).
                set_route(scope, DATA_PLANE)
                # Log lines of the request (auto-resume included) are about its sandbox.
                with sandbox_context(route.sandbox_id):
                    await self._forward(route, scope, receive, send)
                return
        elif kind == "lifespan":
            await self.control_app(scope, receive, self._lifespan_send(send))
            return
        await self.control_app(scope, receive, send)

    async def _forward(self, route: Route, scope: Scope, receive: Receive, send: Send) -> None:
        if route.port == ENVD_PORT and _internal(scope["path"], route.strip_proxy_prefix):
            # Before resolving: a refused request neither finds nor wakes the sandbox.
            err: AenvError = Forbidden(f"{scope['path']} is internal to the sandbox's agent")
            await self._error(scope, send, err.status, err.to_json())
            return
        try:
            upstream = await self.resolver(route.sandbox_id, route.port, _traffic_token(scope))
        except AenvError as exc:
            log.debug("proxy: %s:%s: %s", route.sandbox_id, route.port, exc.message)
            await self._error(scope, send, exc.status, exc.to_json())
            return
        except TimeoutError:
            err = GatewayTimeout(f"sandbox {route.sandbox_id} did not become ready")
            await self._error(scope, send, err.status, err.to_json())
            return
        except Exception:
            log.exception(
                "proxy: resolving sandbox %s port %s failed", route.sandbox_id, route.port
            )
            err = InternalError(f"could not resolve sandbox {route.sandbox_id}")
            await self._error(scope, send, err.status, err.to_json())
            return

        target = self.target(route, scope, upstream)
        if scope["type"] == "http":
            await self.http.forward(scope, receive, send, target)
        else:
            await self.ws.forward(scope, receive, send, target)

    def target(self, route: Route, scope: Scope, upstream: Upstream) -> Target:
        return Target(
            sandbox_id=route.sandbox_id,
            sandbox_port=route.port,
            host=upstream.host,
            port=upstream.port,
            raw_path=self.target_path(route, scope),
            query=scope.get("query_string", b""),
            headers=self.target_headers(route, scope, upstream),
        )

    # Extension points: a gateway in front of nodes keeps the routing headers and the path
    # as they came, for the node to route by.
    def target_headers(
        self, route: Route, scope: Scope, upstream: Upstream
    ) -> list[tuple[bytes, bytes]]:
        return _forwarded_headers(scope["headers"], upstream.host_header)

    def target_path(self, route: Route, scope: Scope) -> bytes:
        raw_path: bytes = scope.get("raw_path") or quote(scope["path"]).encode()
        if route.strip_proxy_prefix:
            raw_path = raw_path[len(b"/proxy") :] or b"/"
        return raw_path

    @staticmethod
    async def _error(scope: Scope, send: Send, status: int, payload: dict[str, object]) -> None:
        if scope["type"] == "http":
            await send_json(send, status, payload)
        else:
            await deny_websocket_json(scope, send, status, payload)

    def _lifespan_send(self, send: Send) -> Send:
        async def wrapped(message: Message) -> None:
            if message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                await self.aclose()
            await send(message)

        return wrapped

    # -- housekeeping ------------------------------------------------------------------

    def drop(self, sandbox_id: str) -> None:
        """Breaks off every connection to a sandbox whose processes ended (the node calls it
        on kill, loss and the pauses that stop them)."""
        self.http.drop(sandbox_id)
        self.ws.drop(sandbox_id)

    async def aclose(self) -> None:
        await self.http.aclose()
