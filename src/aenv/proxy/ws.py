"""WebSocket forwarding: handshake with the sandbox first, then accept the client and bridge.

The upstream handshake goes first so that the client gets what the sandbox decided: the
subprotocol it picked, its extra response headers (cookies...), or its refusal (status,
headers and body, through the ASGI denial-response extension). No compression on the
sandbox leg (it is local; the ASGI server negotiates compression with the client on its own)
and no pings from the proxy (the ASGI server pings the client). Close codes and reasons are
passed on in both directions; the codes that may not appear in a close frame become 1000
(1005, no status) or 1014/1001 (an abnormal end).

What a sandbox sends is untrusted, and so is a client that stops reading: the server's memory
per connection is bounded both ways. A message over `MAX_MESSAGE` closes both legs with 1009
(the websockets client refuses it from the frame header on, before buffering it; the ASGI
server does the same for clients with `SERVER_OPTIONS`). Each direction reads its next message
only once the last one was written out: the sandbox leg stops reading from its socket after
`max_queue` frames nobody took, the ASGI send waits for the client's socket to drain, and
`upstream.send` waits for the sandbox's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.http11 import Request
from websockets.typing import Subprotocol
from websockets.uri import WebSocketURI, parse_uri

from ._common import (
    Exposer,
    Receive,
    Scope,
    Send,
    Target,
    canonical_name,
    connect_exposing,
    deny_websocket,
    deny_websocket_json,
    end_to_end,
)

log = logging.getLogger(__name__)

# The client's handshake headers that belong to its own connection with us.
_REQUEST_DROP = frozenset(
    {
        b"host",  # set on the protocol below (the websockets client would add a second one)
        b"sec-websocket-key",
        b"sec-websocket-version",
        b"sec-websocket-extensions",
        b"sec-websocket-protocol",
        b"sec-websocket-accept",
        b"content-length",
    }
)
# The sandbox's handshake response headers that belong to its connection with us.
_RESPONSE_DROP = frozenset(
    {
        "connection",
        "upgrade",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "sec-websocket-accept",
        "sec-websocket-protocol",
        "sec-websocket-extensions",
        "date",
        "server",
    }
)
# The largest message either leg takes (uvicorn's default for clients, and what it is set to).
MAX_MESSAGE = 16 * 1024 * 1024
# Frames the sandbox leg buffers before it stops reading from the sandbox.
MAX_QUEUE = 4
# The options of the ASGI server (uvicorn) that bound the client leg alike: the websockets
# sans-I/O protocol reads one message at a time and its send waits for the socket to drain.
SERVER_OPTIONS: dict[str, Any] = {"ws": "websockets-sansio", "ws_max_size": MAX_MESSAGE}
_SENDABLE = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014})


def _close_code(code: int | None, *, abnormal: int) -> int:
    if code is None or code == 1006 or code == 1015:
        return abnormal
    if code == 1005:
        return 1000
    if code in _SENDABLE or 3000 <= code < 5000:
        return code
    return 1011


class _UpstreamProtocol(ClientProtocol):
    """A websockets client protocol that sends a given `Host` instead of the URI's."""

    def __init__(self, uri: WebSocketURI, *, host_header: str | None, **kwargs: Any) -> None:
        super().__init__(uri, **kwargs)
        self._host_header = host_header

    def connect(self) -> Request:
        request = super().connect()
        if self._host_header is not None:
            del request.headers["Host"]
            request.headers["Host"] = self._host_header
        return request


class WebSocketForwarder:
    """Bridges one ASGI WebSocket connection to a resolved `Target`."""

    def __init__(
        self,
        *,
        connect_timeout: float = 5.0,
        handshake_timeout: float = 30.0,
        close_timeout: float = 5.0,
        max_size: int = MAX_MESSAGE,
        max_queue: int = MAX_QUEUE,
        expose: Exposer | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.expose = expose
        self.handshake_timeout = handshake_timeout
        self.close_timeout = close_timeout
        self.max_size = max_size
        self.max_queue = max_queue
        # The bridged sandbox legs by sandbox, for `drop`.
        self._open: dict[str, set[ClientConnection]] = {}

    async def forward(self, scope: Scope, receive: Receive, send: Send, target: Target) -> None:
        """Expects the `websocket.connect` message to be still unread."""
        if (await receive())["type"] != "websocket.connect":
            return
        upstream = await self._connect(scope, send, target)
        if upstream is None:
            return
        legs = self._open.setdefault(target.sandbox_id, set())
        legs.add(upstream)
        try:
            extra = [
                (name.lower().encode("latin-1"), value.encode("latin-1"))
                for name, value in (
                    upstream.response.headers.raw_items() if upstream.response else []
                )
                if name.lower() not in _RESPONSE_DROP
            ]
            try:
                await send(
                    {
                        "type": "websocket.accept",
                        "subprotocol": upstream.subprotocol,
                        "headers": extra,
                    }
                )
            except OSError:
                return
            await self._bridge(receive, send, upstream)
        finally:
            upstream.transport.abort()
            legs.discard(upstream)
            if not legs and self._open.get(target.sandbox_id) is legs:
                del self._open[target.sandbox_id]

    def drop(self, sandbox_id: str) -> None:
        """Breaks off the WebSockets bridged to a sandbox whose processes ended: the client
        gets an abnormal close (1014) at once instead of a silent connection."""
        for leg in self._open.pop(sandbox_id, set()):
            leg.transport.abort()

    async def _connect(self, scope: Scope, send: Send, target: Target) -> ClientConnection | None:
        host_header: str | None = None
        for name, value in target.headers:
            if name == b"host":
                host_header = value.decode("latin-1")
        headers = [
            (canonical_name(name).decode("latin-1"), value.decode("latin-1"))
            for name, value in end_to_end(target.headers, _REQUEST_DROP)
        ]
        subprotocols = [Subprotocol(p) for p in scope.get("subprotocols") or []]
        path = target.request_target.decode("latin-1")
        try:
            protocol = _UpstreamProtocol(
                parse_uri(f"ws://{target.authority}{path}"),
                host_header=host_header,
                subprotocols=subprotocols or None,
                extensions=None,
                max_size=self.max_size,
            )
        except Exception as exc:  # a request target websockets will not send
            await deny_websocket_json(scope, send, 400, {"code": 400, "message": str(exc)})
            return None

        def factory() -> ClientConnection:
            return ClientConnection(
                protocol,
                ping_interval=None,
                ping_timeout=None,
                close_timeout=self.close_timeout,
                max_queue=self.max_queue,
            )

        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await connect_exposing(
                    lambda: loop.create_connection(factory, target.host, target.port),
                    target,
                    self.expose,
                )
        except (OSError, TimeoutError) as exc:
            reason = (
                "connect timed out"
                if isinstance(exc, TimeoutError)
                else ("connection refused" if isinstance(exc, ConnectionRefusedError) else str(exc))
            )
            await deny_websocket_json(scope, send, 502, target.unreachable(reason))
            return None
        try:
            async with asyncio.timeout(self.handshake_timeout):
                await connection.handshake(headers, user_agent_header=None)
        except InvalidStatus as exc:
            connection.transport.abort()
            response = exc.response
            denial = [
                (name.lower().encode("latin-1"), value.encode("latin-1"))
                for name, value in response.headers.raw_items()
                if name.lower() not in _RESPONSE_DROP
            ]
            await deny_websocket(
                scope, send, response.status_code, denial, bytes(response.body or b"")
            )
            return None
        except (OSError, TimeoutError, InvalidHandshake, EOFError) as exc:
            connection.transport.abort()
            reason = (
                "websocket handshake timed out"
                if isinstance(exc, TimeoutError)
                else (f"websocket handshake failed: {exc}")
            )
            await deny_websocket_json(scope, send, 502, target.unreachable(reason))
            return None
        except BaseException:
            connection.transport.abort()
            raise
        return connection

    async def _bridge(self, receive: Receive, send: Send, upstream: ClientConnection) -> None:
        client_closed = False  # the client said goodbye, or we told it to

        async def client_to_upstream() -> None:
            nonlocal client_closed
            try:
                while True:
                    message = await receive()
                    kind = message["type"]
                    if kind == "websocket.receive":
                        data = message.get("bytes")
                        if data is None:
                            data = message.get("text") or ""
                        if len(data) > self.max_size:  # an ASGI server without the bound
                            client_closed = True
                            await upstream.close(1009, "message too big")
                            await _close_client(send, 1009, "message too big")
                            return
                        await upstream.send(data)
                    elif kind == "websocket.disconnect":
                        client_closed = True
                        code = _close_code(message.get("code"), abnormal=1001)
                        await upstream.close(code, message.get("reason") or "")
                        return
            except ConnectionClosed:
                return  # the other direction reports the upstream's close

        async def upstream_to_client() -> None:
            nonlocal client_closed
            try:
                while True:
                    data = await upstream.recv()
                    if isinstance(data, str):
                        await send({"type": "websocket.send", "text": data})
                    else:
                        await send({"type": "websocket.send", "bytes": data})
            except ConnectionClosed as exc:
                if exc.rcvd is not None:
                    code, reason = exc.rcvd.code, exc.rcvd.reason
                elif exc.sent is not None and exc.sent.code in (1002, 1007, 1009):
                    # We failed the sandbox leg (a message over max_size, bad UTF-8, a
                    # protocol error): the client learns why.
                    code, reason = exc.sent.code, exc.sent.reason
                else:
                    code, reason = None, ""
            except OSError:
                return  # the client is gone
            if not client_closed:
                client_closed = True
                await _close_client(send, _close_code(code, abnormal=1014), reason)

        down = asyncio.ensure_future(client_to_upstream())
        up = asyncio.ensure_future(upstream_to_client())
        try:
            await asyncio.wait({down, up}, return_when=asyncio.FIRST_COMPLETED)
            # Let the other side finish its part of the closing handshake, briefly.
            await asyncio.wait({down, up}, timeout=self.close_timeout)
        finally:
            for task in (down, up):
                task.cancel()
            for task in (down, up):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


async def _close_client(send: Send, code: int, reason: str) -> None:
    with contextlib.suppress(OSError):
        await send({"type": "websocket.close", "code": code, "reason": reason})
