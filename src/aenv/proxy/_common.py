"""Shared pieces of the data-plane proxy: ASGI types, the resolved target, header hygiene."""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import struct
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar

from aenv.domain import ENVD_PORT

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
# (sandbox id, port) -> whether a port found refused may now be reached (the sandbox
# forwards a loopback-only listener on it); see `envd/portfwd.py`.
Exposer = Callable[[str, int], Awaitable[bool]]
_T = TypeVar("_T")

#: Headers that pick the sandbox and port; they never reach the sandbox.
ROUTING_HEADERS = frozenset(
    {b"e2b-sandbox-id", b"e2b-sandbox-port", b"x-agentenv-sandbox-id", b"x-agentenv-target-port"}
)

#: RFC 9110 §7.6.1 connection-specific headers (plus the legacy ones still seen in the wild).
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)


@dataclass(frozen=True, slots=True)
class Target:
    """Where one routed request goes, and what of it is forwarded.

    `headers` are the client's headers minus the routing headers (hop-by-hop headers are the
    forwarders' business: HTTP and WebSocket treat `connection`/`upgrade` differently).
    `raw_path` is the request target's path as the client sent it (percent-encoding intact),
    `query` the raw query string without `?`.
    """

    sandbox_id: str
    sandbox_port: int
    host: str
    port: int
    raw_path: bytes
    query: bytes
    headers: Headers

    @property
    def request_target(self) -> bytes:
        return self.raw_path + b"?" + self.query if self.query else self.raw_path

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def unreachable(self, reason: str) -> dict[str, object]:
        """E2B's edge answer for a running sandbox whose port takes no connection (clients
        match its message); `detail` says what failed."""
        return {
            "code": 502,
            "message": "The sandbox is running but port is not open",
            "sandboxId": self.sandbox_id,
            "port": self.sandbox_port,
            "detail": reason,
        }


def connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    """Header names nominated as hop-by-hop by `Connection` (lowercased)."""
    tokens: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return tokens


def end_to_end(headers: Iterable[tuple[bytes, bytes]], also_drop: frozenset[bytes]) -> Headers:
    """`headers` without hop-by-hop headers, those named by `Connection`, and `also_drop`.

    Names must already be lowercase (ASGI guarantees it for request headers)."""
    headers = list(headers)
    extra = connection_tokens(headers)
    return [
        (name, value)
        for name, value in headers
        if name not in HOP_BY_HOP and name not in also_drop and name not in extra
    ]


_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


@functools.lru_cache(maxsize=1024)
def canonical_name(name: bytes) -> bytes:
    """A header name as E2B's (Go) proxy writes it to the sandbox: `Host`, `Content-Type`,
    `X-Test-Token` (Go's CanonicalMIMEHeaderKey); a name with a byte outside the token set
    is left as it is. ASGI gives lowercase names, and an app that prints what it received
    (`self.headers.items()`) should see what it would see behind E2B."""
    if not name or any(b not in _TOKEN for b in name):
        return name
    return b"-".join(part[:1].upper() + part[1:].lower() for part in name.split(b"-"))


def json_body(payload: dict[str, object]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


async def send_json(send: Send, status: int, payload: dict[str, object]) -> None:
    """A complete JSON HTTP response."""
    body = json_body(payload)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def reset_client(send: Send) -> bool:
    """Ends the client's connection with a TCP reset instead of a clean close. A response
    broken off by a clean close reads as a malformed body to some clients (the Python SDK's
    HTTP stack), a reset as the connection lost, which is what they probe the sandbox's
    health on (and then report it killed). ASGI has no message for this: uvicorn's `send` is
    a bound method of its per-request cycle, which holds the transport. False elsewhere (the
    caller's clean close stands). A middleware that wraps `send` marks its wrapper with
    `__wrapped__` (functools' convention), which is followed here: without it
    the node's metrics middleware hid the transport and every reset became a clean close."""
    inner: Any = send
    for _ in range(8):  # a few middlewares deep at most
        if hasattr(inner, "__self__") or not hasattr(inner, "__wrapped__"):
            break
        inner = inner.__wrapped__
    transport = getattr(getattr(inner, "__self__", None), "transport", None)
    # Duck-typed: uvloop's transports are not asyncio.BaseTransport subclasses.
    abort = getattr(transport, "abort", None)
    get_extra_info = getattr(transport, "get_extra_info", None)
    if abort is None or get_extra_info is None:
        return False
    sock = get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    abort()
    return True


async def deny_websocket(
    scope: Scope, send: Send, status: int, headers: Headers, body: bytes
) -> None:
    """Refuse a WebSocket handshake with an HTTP response when the server supports the ASGI
    denial-response extension (uvicorn does); otherwise close, which servers answer with 403."""
    if "websocket.http.response" in (scope.get("extensions") or {}):
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body, "more_body": False})
    else:
        await send({"type": "websocket.close", "code": 1008 if status < 500 else 1014})


async def deny_websocket_json(
    scope: Scope, send: Send, status: int, payload: dict[str, object]
) -> None:
    body = json_body(payload)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await deny_websocket(scope, send, status, headers, body)


async def connect_exposing(
    connect: Callable[[], Awaitable[_T]], target: Target, expose: Exposer | None
) -> _T:
    """`connect()`, and once more if it was refused and `expose` made the port reachable
    (a process in the sandbox listens on it on loopback only). envd's own port is never
    forwarded: a refusal there is an answer."""
    try:
        return await connect()
    except ConnectionRefusedError:
        if (
            expose is None
            or target.sandbox_port == ENVD_PORT
            or not await expose(target.sandbox_id, target.sandbox_port)
        ):
            raise
    return await connect()
