"""The data-plane proxy's test servers on loopback, for the proxy's unit tests.

An upstream ASGI app (echo, gated streams, a duplex echo, big bodies, WebSocket echo) and the
SandboxRouter are each served by uvicorn on their own loopback port; a resolver maps test
sandbox ids to the upstream (or to a closed port, or to errors), and a small control app
takes everything that is not routed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from aenv.domain import Upstream
from aenv.errors import Forbidden, SandboxNotFound
from aenv.proxy import SandboxRouter
from tests.helpers import free_port, uvicorn_task

MiB = 1 << 20


# --------------------------------------------------------------------------- upstream app


@dataclass
class UpstreamState:
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    produced: list[str] = field(default_factory=list)
    hang_disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    duplex_seen: list[bytes] = field(default_factory=list)
    ws_handshakes: list[dict[str, Any]] = field(default_factory=list)
    ws_close: list[tuple[int, str]] = field(default_factory=list)
    ws_closed: asyncio.Event = field(default_factory=asyncio.Event)


def _pattern(n: int) -> bytes:
    block = bytes(range(256)) * 256  # 64 KiB
    return (block * (n // len(block) + 1))[:n]


def _headers_dict(scope: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k, v in scope["headers"]:
        out.setdefault(k.decode("latin-1"), []).append(v.decode("latin-1"))
    return out


async def _read_body(receive: Any) -> bytes:
    body = bytearray()
    while True:
        m = await receive()
        if m["type"] != "http.request":
            break
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    return bytes(body)


def make_upstream(state: UpstreamState) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            await ws_app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        params = dict(
            p.split("=", 1) for p in scope["query_string"].decode().split("&") if "=" in p
        )

        async def start(
            status: int = 200, headers: list[tuple[bytes, bytes]] | None = None
        ) -> None:
            await send({"type": "http.response.start", "status": status, "headers": headers or []})

        async def body(data: bytes, more: bool = False) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": more})

        if path == "/stream":
            await start(200, [(b"content-type", b"text/plain")])
            state.produced.append("first")
            await body(b"first\n", True)
            await state.gate.wait()
            for word in ("second", "third"):
                state.produced.append(word)
                await body(word.encode() + b"\n", True)
                await asyncio.sleep(0.01)
            await body(b"")
        elif path == "/duplex":
            # Echo each request body message as soon as it arrives, as a response chunk.
            await start(200, [(b"content-type", b"application/octet-stream")])
            while True:
                m = await receive()
                if m["type"] != "http.request":
                    return
                data = m.get("body", b"")
                if data:
                    state.duplex_seen.append(data)
                    await body(b"echo:" + data + b";", True)
                if not m.get("more_body"):
                    break
            await body(b"end")
        elif path == "/hang":
            await _read_body(receive)
            await start(200)
            await body(b"tick\n", True)
            m = await receive()  # blocks until the client (i.e. the proxy) goes away
            if m["type"] == "http.disconnect":
                state.hang_disconnected.set()
        elif path == "/mirror":
            data = await _read_body(receive)
            if params.get("chunked"):
                await start(200)
                for i in range(0, len(data), 100_000):
                    await body(data[i : i + 100_000], True)
                await body(b"")
            else:
                await start(200, [(b"content-length", str(len(data)).encode())])
                await body(data)
        elif path == "/big":
            n = int(params["n"])
            data = _pattern(n)
            if params.get("chunked"):
                await start(200)
                for i in range(0, n, 1 << 16):
                    await body(data[i : i + (1 << 16)], True)
                await body(b"")
            else:
                await start(200, [(b"content-length", str(n).encode())])
                await body(data)
        elif path.startswith("/status/"):
            await _read_body(receive)
            code = int(path.rsplit("/", 1)[1])
            extra = [(b"location", b"/elsewhere")] if 300 <= code < 400 else []
            await start(code, extra)
            await body(b"")
        else:
            data = await _read_body(receive)
            out = json.dumps(
                {
                    "method": scope["method"],
                    "path": path,
                    "raw_path": scope.get("raw_path", b"").decode("latin-1"),
                    "query": scope["query_string"].decode("latin-1"),
                    "headers": _headers_dict(scope),
                    "client_port": scope["client"][1] if scope.get("client") else None,
                    "body_len": len(data),
                    "body_sha256": hashlib.sha256(data).hexdigest(),
                    "body": data.decode("latin-1") if len(data) < 256 else None,
                }
            ).encode()
            await start(
                200,
                [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(out)).encode()),
                    (b"x-upstream", b"yes"),
                    (b"connection", b"keep-alive, x-hop-resp"),
                    (b"x-hop-resp", b"should-not-pass"),
                ],
            )
            await body(out)

    async def ws_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        m = await receive()
        assert m["type"] == "websocket.connect"
        state.ws_handshakes.append({"path": scope["path"], "headers": _headers_dict(scope)})
        if scope["path"] == "/ws-deny":
            await send(
                {
                    "type": "websocket.http.response.start",
                    "status": 403,
                    "headers": [(b"content-type", b"text/plain"), (b"x-why", b"policy")],
                }
            )
            await send(
                {"type": "websocket.http.response.body", "body": b"nope", "more_body": False}
            )
            return
        subprotocols = scope.get("subprotocols") or []
        await send(
            {
                "type": "websocket.accept",
                "subprotocol": subprotocols[0] if subprotocols else None,
                "headers": [(b"x-upstream", b"ws")],
            }
        )
        while True:
            m = await receive()
            if m["type"] == "websocket.disconnect":
                state.ws_close.append((m.get("code", 0), m.get("reason") or ""))
                state.ws_closed.set()
                return
            text = m.get("text")
            if text is not None and text.startswith("close:"):
                _, code, reason = text.split(":", 2)
                await send({"type": "websocket.close", "code": int(code), "reason": reason})
                return
            if text is not None:
                await send({"type": "websocket.send", "text": text})
            else:
                await send({"type": "websocket.send", "bytes": m["bytes"]})

    return app


# --------------------------------------------------------------------------- control app


@dataclass
class ControlState:
    lifespan: list[str] = field(default_factory=list)


def make_control(state: ControlState) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                m = await receive()
                if m["type"] == "lifespan.startup":
                    state.lifespan.append("startup")
                    await send({"type": "lifespan.startup.complete"})
                elif m["type"] == "lifespan.shutdown":
                    state.lifespan.append("shutdown")
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        elif scope["type"] == "http":
            await _read_body(receive)
            out = json.dumps({"plane": "control", "path": scope["path"]}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": out})
        elif scope["type"] == "websocket":
            await receive()
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.send", "text": "control"})
            await send({"type": "websocket.close", "code": 1000})

    return app


# --------------------------------------------------------------------------- servers


def serve(app: Any, *, lifespan: str = "off") -> contextlib.AbstractAsyncContextManager[int]:
    return uvicorn_task(
        app, lifespan=lifespan, server_header=False, date_header=False, timeout_keep_alive=30
    )


@dataclass
class Env:
    upstream_port: int
    proxy_port: int
    dead_port: int
    upstream: UpstreamState
    control: ControlState
    router: SandboxRouter
    resolved: list[tuple[str, int]]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def client(self, **kw: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, trust_env=False, timeout=30, **kw)


@contextlib.asynccontextmanager
async def proxy_servers() -> AsyncIterator[Env]:
    upstream = UpstreamState()
    control = ControlState()
    resolved: list[tuple[str, int]] = []
    dead_port = free_port()
    async with serve(make_upstream(upstream)) as upstream_port:

        async def resolver(sandbox_id: str, port: int, token: str | None) -> Upstream:
            resolved.append((sandbox_id, port))
            if sandbox_id == "private":
                if token != "t0k":
                    raise Forbidden("sandbox private is private")
                return Upstream("127.0.0.1", upstream_port, host_header=f"masked:{port}")
            if sandbox_id == "missing":
                raise SandboxNotFound(sandbox_id)
            if sandbox_id == "paused":
                raise SandboxNotFound(sandbox_id, state="paused")
            if sandbox_id == "boom":
                raise RuntimeError("resolver bug")
            if sandbox_id == "dead":
                return Upstream("127.0.0.1", dead_port)
            return Upstream("127.0.0.1", upstream_port)

        async def signed_by(path: str, op: str, user: str, sig: str, exp: str | None) -> str | None:
            return (
                "signer"
                if (path, op, user, sig, exp) == ("/a b", "read", "", "v1_+/", None)
                else None
            )

        router = SandboxRouter(
            make_control(control), resolver, ["localhost", "sbx.test"], signed_by=signed_by
        )
        async with serve(router, lifespan="on") as proxy_port:
            yield Env(upstream_port, proxy_port, dead_port, upstream, control, router, resolved)
    assert control.lifespan == ["startup", "shutdown"]


ENVD = {"e2b-sandbox-id": "sbx1", "e2b-sandbox-port": "49983"}


async def _no_control_app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the request should have been routed to a sandbox")
