"""The data-plane proxy against real servers on loopback.

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
import pytest
import pytest_asyncio
import websockets
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from aenv.domain import Upstream
from aenv.errors import Forbidden, SandboxNotFound
from aenv.proxy import ConnectionPool, HttpForwarder, SandboxRouter
from tests.helpers import free_port, uvicorn_task

pytestmark = pytest.mark.asyncio(loop_scope="session")

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


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env() -> AsyncIterator[Env]:
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

        def signed_by(path: str, op: str, user: str, sig: str, exp: str | None) -> str | None:
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


# --------------------------------------------------------------------------- routing


async def test_header_routing_defaults_to_envd_port(env: Env) -> None:
    async with env.client() as c:
        r = await c.get("/health", headers={"e2b-sandbox-id": "sbx1"})
    assert r.status_code == 200
    assert r.json()["path"] == "/health"
    assert env.resolved[-1] == ("sbx1", 49983)


@pytest.mark.parametrize(
    ("headers", "expected_port"),
    [
        ({"e2b-sandbox-id": "sbx1", "e2b-sandbox-port": "49999"}, 49999),
        ({"x-agentenv-sandbox-id": "sbx1", "x-agentenv-target-port": "8080"}, 8080),
        ({"x-agentenv-sandbox-id": "sbx1", "e2b-sandbox-port": "3000"}, 3000),
        ({"e2b-sandbox-id": "sbx1", "x-agentenv-target-port": "5173"}, 5173),
    ],
)
async def test_header_routing_aliases(
    env: Env, headers: dict[str, str], expected_port: int
) -> None:
    async with env.client() as c:
        r = await c.post("/process.Process/List", headers=headers, content=b"{}")
    assert r.status_code == 200
    assert env.resolved[-1] == ("sbx1", expected_port)
    assert r.json()["path"] == "/process.Process/List"


async def test_headers_stripped_and_passed(env: Env) -> None:
    headers = {
        **ENVD,
        "x-agentenv-sandbox-id": "sbx1",
        "x-agentenv-target-port": "49983",
        "x-access-token": "tok",
        "authorization": "Basic dXNlcjo=",
        "cookie": "a=b",
        "x-custom": "1",
        "connection": "keep-alive, x-hop",
        "x-hop": "drop-me",
        "keep-alive": "timeout=5",
        "te": "trailers",
        "content-type": "application/json",
    }
    async with env.client() as c:
        r = await c.post("/a%20b/c%2Fd?x=1&y=%2F&z", headers=headers, content=b'{"k":1}')
    assert r.status_code == 200
    seen = r.json()
    h = seen["headers"]
    for name in (
        "e2b-sandbox-id",
        "e2b-sandbox-port",
        "x-agentenv-sandbox-id",
        "x-agentenv-target-port",
        "x-hop",
        "keep-alive",
        "te",
        "transfer-encoding",
    ):
        assert name not in h, name
    assert h["x-access-token"] == ["tok"]
    assert h["authorization"] == ["Basic dXNlcjo="]
    assert h["cookie"] == ["a=b"]
    assert h["x-custom"] == ["1"]
    assert h["content-type"] == ["application/json"]
    assert h["host"] == [f"127.0.0.1:{env.proxy_port}"]  # Host is passed unchanged
    assert h["content-length"] == ["7"]
    assert seen["raw_path"] == "/a%20b/c%2Fd"
    assert seen["query"] == "x=1&y=%2F&z"
    assert seen["body"] == '{"k":1}'
    # response side: end-to-end headers pass, hop-by-hop ones do not
    assert r.headers["x-upstream"] == "yes"
    assert "x-hop-resp" not in r.headers
    assert r.headers["content-type"] == "application/json"


async def test_proxy_prefix(env: Env) -> None:
    async with env.client() as c:
        r = await c.get("/proxy/health?q=1", headers=ENVD)
        assert r.status_code == 200 and r.json()["path"] == "/health"
        assert r.json()["query"] == "q=1"
        r = await c.get("/proxy", headers={"x-agentenv-sandbox-id": "sbx1"})
        assert r.status_code == 200 and r.json()["path"] == "/"
        r = await c.get("/proxy/health")
        assert r.status_code == 400
        assert r.headers["content-type"] == "application/json"
        assert r.json()["code"] == 400 and "sandbox" in r.json()["message"]
        r = await c.get("/proxy")
        assert r.status_code == 400
        r = await c.get("/proxyfoo")
        assert r.json() == {"plane": "control", "path": "/proxyfoo"}


async def test_host_routing(env: Env) -> None:
    async with env.client() as c:
        r = await c.get(
            "/index.html?a=b", headers={"host": f"8080-sbx1.localhost:{env.proxy_port}"}
        )
        assert r.status_code == 200
        assert env.resolved[-1] == ("sbx1", 8080)
        assert r.json()["path"] == "/index.html"
        assert r.json()["headers"]["host"] == [f"8080-sbx1.localhost:{env.proxy_port}"]
        r = await c.get("/proxy/x", headers={"host": "3000-sbx1.SBX.test"})
        assert r.status_code == 200 and r.json()["path"] == "/proxy/x"
        assert env.resolved[-1] == ("sbx1", 3000)
        # other names under the domain, and other domains, are the control plane
        for host in (
            "api.localhost",
            "localhost",
            "8080-sbx1.example.com",
            "a.8080-sbx1.localhost",
        ):
            r = await c.get("/sandboxes", headers={"host": host})
            assert r.json() == {"plane": "control", "path": "/sandboxes"}, host
        # malformed sandbox hosts are refused
        long_label = "8080-" + "a" * 59  # 64 characters
        for host in (f"{long_label}.localhost", "0-sbx1.localhost", "70000-sbx1.localhost"):
            r = await c.get("/", headers={"host": host})
            assert r.status_code == 400, host
            assert r.json()["code"] == 400
        ok_label = "8080-" + "a" * 58  # 63 characters
        r = await c.get("/", headers={"host": f"{ok_label}.localhost"})
        assert r.status_code == 200


async def _no_control_app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the request should have been routed to a sandbox")


async def test_route_parsing() -> None:
    async def resolver(sandbox_id: str, port: int, token: str | None) -> Upstream:
        raise AssertionError

    router = SandboxRouter(_no_control_app, resolver, ["Example.COM.", ""])

    def route(host: str, path: str = "/", **headers: str) -> object:
        hs = [(b"host", host.encode())] + [
            (k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()
        ]
        return router.route(
            {"type": "http", "path": path, "raw_path": path.encode(), "headers": hs}
        )

    r = route("49999-AbC123.example.com.:443")
    assert r is not None and (r.sandbox_id, r.port) == ("AbC123", 49999)  # type: ignore[attr-defined]
    assert route("[::1]:8000") is None
    assert route("example.com") is None
    assert route("www.example.com") is None
    assert route("localhost:8000") is None
    r = route("h", "/proxy/x", x_agentenv_sandbox_id="a", e2b_sandbox_id="b", e2b_sandbox_port="1")
    assert r is not None and (r.sandbox_id, r.port, r.strip_proxy_prefix) == ("a", 1, True)  # type: ignore[attr-defined]


async def test_bad_routing_headers(env: Env) -> None:
    async with env.client() as c:
        for headers in (
            {"e2b-sandbox-id": "sbx1", "e2b-sandbox-port": "http"},
            {"e2b-sandbox-id": "sbx1", "e2b-sandbox-port": "0"},
            {"e2b-sandbox-id": "sbx1", "e2b-sandbox-port": "65536"},
            {"e2b-sandbox-id": ""},
            {"e2b-sandbox-id": "../etc"},
        ):
            r = await c.get("/health", headers=headers)
            assert r.status_code == 400, headers
            assert r.json()["code"] == 400


async def test_resolver_errors_become_json(env: Env) -> None:
    async with env.client() as c:
        # E2B's edge answers: the SDKs read "was not found" in a 502 as "not running"
        r = await c.get("/health", headers={"e2b-sandbox-id": "missing"})
        assert r.status_code == 502
        assert r.json() == {
            "code": 502,
            "message": "The sandbox was not found",
            "sandboxId": "missing",
        }
        r = await c.get("/health", headers={"e2b-sandbox-id": "paused"})
        assert r.status_code == 502
        assert r.json()["message"] == "The sandbox was not found"
        assert r.json()["state"] == "paused"
        r = await c.get("/health", headers={"e2b-sandbox-id": "boom"})
        assert r.status_code == 500
        assert r.json()["code"] == 500


async def test_signed_file_urls_go_to_the_sandbox_that_signed(env: Env) -> None:
    """`download_url()` against the node's address (E2B_SANDBOX_URL) names no sandbox."""
    async with env.client() as c:
        r = await c.get("/files", params={"path": "/a b", "signature": "v1_+/"})
        assert r.status_code == 200 and r.json()["path"] == "/files"
        assert env.resolved[-1] == ("signer", 49983)
        r = await c.get("/proxy/files", params={"path": "/a b", "signature": "v1_+/"})
        assert r.status_code == 200 and r.json()["path"] == "/files"
        r = await c.get("/files", params={"path": "/a b", "signature": "v1_forged"})
        assert r.status_code == 401 and r.json()["message"] == "invalid signature"
        r = await c.get("/files", params={"path": "/a b"})
        assert r.json() == {"plane": "control", "path": "/files"}  # unsigned: not ours


@pytest.mark.parametrize(
    "path",
    ["/init", "/init/", "/%69nit", "/envs", "/metrics", "/logs", "/forward", "/oom", "/proxy/init"],
)
async def test_envd_internal_routes_are_refused(env: Env, path: str) -> None:
    before = len(env.resolved)
    async with env.client() as c:
        r = await c.post(path, headers=ENVD, content=b"{}")
    assert r.status_code == 403
    assert r.json()["code"] == 403 and "internal" in r.json()["message"]
    assert len(env.resolved) == before  # refused before the sandbox is looked up or woken
    # The same path on a user's own port is theirs.
    async with env.client() as c:
        r = await c.post(path, headers={"e2b-sandbox-id": "sbx1", "e2b-sandbox-port": "8080"})
    assert r.status_code == 200


async def test_traffic_token_goes_to_the_resolver_not_the_sandbox(env: Env) -> None:
    private = {"e2b-sandbox-id": "private", "e2b-sandbox-port": "8080"}
    async with env.client() as c:
        r = await c.get("/app", headers=private)
        assert r.status_code == 403 and r.json()["code"] == 403
        r = await c.get("/app", headers={**private, "e2b-traffic-access-token": "t0k"})
    assert r.status_code == 200
    seen = r.json()["headers"]
    assert "e2b-traffic-access-token" not in seen
    assert seen["host"] == ["masked:8080"]  # the sandbox's host mask, not the client's Host


async def test_unreachable_upstream_is_502(env: Env) -> None:
    async with env.client() as c:
        r = await c.get("/health", headers={"e2b-sandbox-id": "dead"})
    assert r.status_code == 502
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["code"] == 502
    assert body["message"] == "The sandbox is running but port is not open"
    assert body["sandboxId"] == "dead" and body["port"] == 49983
    assert "refused" in body["detail"]


async def test_control_plane_passthrough(env: Env) -> None:
    async with env.client() as c:
        r = await c.get("/health")
        assert r.json() == {"plane": "control", "path": "/health"}
        r = await c.post("/sandboxes", json={"templateID": "base"})
        assert r.json() == {"plane": "control", "path": "/sandboxes"}
    assert env.control.lifespan == ["startup"]
    async with ws_connect(f"ws://127.0.0.1:{env.proxy_port}/ws", proxy=None) as ws:
        assert await ws.recv() == "control"


# --------------------------------------------------------------------------- HTTP semantics


async def test_head_204_and_redirects_pass_through(env: Env) -> None:
    async with env.client() as c:
        r = await c.head("/echo", headers=ENVD)
        assert r.status_code == 200 and r.content == b""
        assert int(r.headers["content-length"]) > 0
        r = await c.post("/status/204", headers=ENVD, content=b"x")
        assert r.status_code == 204 and r.content == b""
        r = await c.get("/status/302", headers=ENVD)
        assert r.status_code == 302 and r.headers["location"] == "/elsewhere"
        r = await c.get("/status/404", headers=ENVD)
        assert r.status_code == 404


async def test_keepalive_connections_are_reused(env: Env) -> None:
    ports = set()
    async with env.client() as c:
        for _ in range(5):
            r = await c.post("/echo", headers=ENVD, content=b"ping")
            ports.add(r.json()["client_port"])
    assert len(ports) == 1
    assert env.router.http.pool.idle_count() >= 1


async def test_pool_drop_and_close(env: Env) -> None:
    async with env.client() as c:
        await c.get("/echo", headers=ENVD)
    pool = env.router.http.pool
    assert pool.idle_count("sbx1") >= 1
    env.router.drop("sbx1")
    assert pool.idle_count("sbx1") == 0
    async with env.client() as c:
        r = await c.get("/echo", headers=ENVD)  # a fresh connection after the drop
    assert r.status_code == 200


async def test_streamed_response_arrives_incrementally(env: Env) -> None:
    env.upstream.gate.clear()
    env.upstream.produced.clear()
    async with env.client() as c, c.stream("GET", "/stream", headers=ENVD) as r:
        assert r.status_code == 200
        chunks = r.aiter_raw()
        first = await asyncio.wait_for(anext(chunks), 5)
        assert first.startswith(b"first\n")
        assert env.upstream.produced == ["first"]  # the rest is not produced yet
        env.upstream.gate.set()
        rest = b"".join([c async for c in chunks])
    assert first + rest == b"first\nsecond\nthird\n"


async def _read_until(reader: asyncio.StreamReader, marker: bytes, buf: bytearray) -> None:
    while marker not in buf:
        data = await asyncio.wait_for(reader.read(65536), 5)
        assert data, f"EOF before {marker!r}; got {bytes(buf)!r}"
        buf += data


async def test_streamed_request_body_arrives_incrementally(env: Env) -> None:
    """A chunked upload whose next chunk is only sent once the echo of the previous one came
    back: it can only finish if the proxy streams both directions."""
    env.upstream.duplex_seen.clear()
    reader, writer = await asyncio.open_connection("127.0.0.1", env.proxy_port)
    writer.write(
        b"POST /duplex HTTP/1.1\r\nhost: x\r\ne2b-sandbox-id: sbx1\r\n"
        b"content-type: application/connect+json\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    buf = bytearray()
    for word in (b"one", b"two", b"three"):
        writer.write(b"%x\r\n%b\r\n" % (len(word), word))
        await writer.drain()
        await _read_until(reader, b"echo:" + word + b";", buf)
    assert env.upstream.duplex_seen == [b"one", b"two", b"three"]
    writer.write(b"0\r\n\r\n")
    await _read_until(reader, b"end\r\n0\r\n\r\n", buf)
    assert buf.startswith(b"HTTP/1.1 200 ")
    assert b"transfer-encoding: chunked" in buf.lower()
    writer.close()


async def test_chunked_request_with_late_body(env: Env) -> None:
    """Headers first, body a while later: the request must reach the sandbox before any body."""
    env.upstream.duplex_seen.clear()
    reader, writer = await asyncio.open_connection("127.0.0.1", env.proxy_port)
    writer.write(
        b"POST /duplex HTTP/1.1\r\nhost: x\r\ne2b-sandbox-id: sbx1\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    await writer.drain()
    buf = bytearray()
    await _read_until(reader, b"\r\n\r\n", buf)  # response head before any body was sent
    assert buf.startswith(b"HTTP/1.1 200 ")
    writer.write(b"5\r\nhello\r\n0\r\n\r\n")
    await _read_until(reader, b"echo:hello;", buf)
    await _read_until(reader, b"0\r\n\r\n", buf)
    writer.close()


async def test_client_disconnect_reaches_the_sandbox(env: Env) -> None:
    env.upstream.hang_disconnected.clear()
    reader, writer = await asyncio.open_connection("127.0.0.1", env.proxy_port)
    writer.write(b"GET /hang HTTP/1.1\r\nhost: x\r\ne2b-sandbox-id: sbx1\r\n\r\n")
    buf = bytearray()
    await _read_until(reader, b"tick\n", buf)
    writer.close()
    await asyncio.wait_for(env.upstream.hang_disconnected.wait(), 5)


async def test_large_bodies_both_ways(env: Env) -> None:
    data = _pattern(8 * MiB + 123)
    digest = hashlib.sha256(data).hexdigest()

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 300_000):
            yield data[i : i + 300_000]

    async with env.client() as c:
        # up, with content-length and chunked
        r = await c.post("/sink", headers=ENVD, content=data)
        assert (r.json()["body_len"], r.json()["body_sha256"]) == (len(data), digest)
        r = await c.post("/sink", headers=ENVD, content=chunks())
        assert (r.json()["body_len"], r.json()["body_sha256"]) == (len(data), digest)
        # down, with content-length and chunked
        for q in ("", "&chunked=1"):
            r = await c.get(f"/big?n={len(data)}{q}", headers=ENVD)
            assert r.status_code == 200 and r.content == data
        # both ways in one request
        for q in ("", "?chunked=1"):
            r = await c.post(f"/mirror{q}", headers=ENVD, content=chunks())
            assert r.status_code == 200 and r.content == data


async def test_stale_pooled_connection_is_retried() -> None:
    """A server that drops a kept-alive connection when the next request arrives on it: the
    request goes again on a fresh connection."""
    per_conn: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n += 1
                per_conn.append(n)
                if n > 1:
                    writer.close()  # "idle timeout" hit just as the request came in
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if b"transfer-encoding: chunked" in head.lower():
                    await reader.readuntil(b"0\r\n\r\n")
                else:
                    await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def resolver(sandbox_id: str, p: int, token: str | None) -> Upstream:
        return Upstream("127.0.0.1", port)

    async def control(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not routed")

    router = SandboxRouter(
        control, resolver, [], http=HttpForwarder(pool=ConnectionPool(idle_timeout=60))
    )
    async with serve(router) as proxy_port, httpx.AsyncClient(trust_env=False) as c:
        url = f"http://127.0.0.1:{proxy_port}/x"
        for _ in range(3):
            r = await c.post(url, headers={"e2b-sandbox-id": "s"}, content=b"abc")
            assert r.status_code == 200 and r.text == "ok"

        async def one_chunk() -> AsyncIterator[bytes]:
            yield b"chunked"

        r = await c.post(url, headers={"e2b-sandbox-id": "s"}, content=one_chunk())
        assert r.status_code == 200 and r.text == "ok"
    await router.aclose()
    server.close()
    assert per_conn.count(2) >= 3  # three requests met a dead pooled connection


@contextlib.asynccontextmanager
async def raw_upstream_router(response: bytes) -> AsyncIterator[str]:
    """A router in front of a raw server that answers every request with `response` bytes and
    then closes the connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(response)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def resolver(sandbox_id: str, p: int, token: str | None) -> Upstream:
        return Upstream("127.0.0.1", port)

    router = SandboxRouter(_no_control_app, resolver, [])
    try:
        async with serve(router) as proxy_port:
            yield f"http://127.0.0.1:{proxy_port}/"
    finally:
        await router.aclose()
        server.close()


async def test_upstream_304_with_content_length() -> None:
    response = b"HTTP/1.1 304 Not Modified\r\netag: x\r\ncontent-length: 100\r\n\r\n"
    async with raw_upstream_router(response) as url, httpx.AsyncClient(trust_env=False) as c:
        r = await c.get(url, headers={"e2b-sandbox-id": "s"})
    assert r.status_code == 304 and r.headers["etag"] == "x"


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhelloXX",
    ],
)
async def test_upstream_breaking_off_truncates_the_client_response(response: bytes) -> None:
    async with raw_upstream_router(response) as url, httpx.AsyncClient(trust_env=False) as c:
        with pytest.raises(httpx.RemoteProtocolError):
            await c.get(url, headers={"e2b-sandbox-id": "s"})


async def test_upstream_garbage_is_502() -> None:
    garbage = b"SSH-2.0-OpenSSH\r\n\r\n"
    async with raw_upstream_router(garbage) as url, httpx.AsyncClient(trust_env=False) as c:
        r = await c.get(url, headers={"e2b-sandbox-id": "s"})
    assert r.status_code == 502 and r.json()["code"] == 502


# --------------------------------------------------------------------------- WebSocket


async def test_websocket_echo_text_binary_and_upstream_close(env: Env) -> None:
    env.upstream.ws_handshakes.clear()
    url = f"ws://127.0.0.1:{env.proxy_port}/ws?room=1"
    async with ws_connect(
        url,
        additional_headers={**ENVD, "x-custom": "v", "origin": "http://example.com"},
        subprotocols=[websockets.Subprotocol("chat.v2"), websockets.Subprotocol("chat.v1")],
        proxy=None,
    ) as ws:
        assert ws.subprotocol == "chat.v2"
        assert ws.response is not None and ws.response.headers["x-upstream"] == "ws"
        await ws.send("hello")
        assert await ws.recv() == "hello"
        payload = bytes(range(256)) * 4096  # 1 MiB binary
        await ws.send(payload)
        assert await ws.recv() == payload
        await ws.send("close:4001:bye now")
        with pytest.raises(ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 5)
    assert info.value.rcvd is not None
    assert (info.value.rcvd.code, info.value.rcvd.reason) == (4001, "bye now")
    hs = env.upstream.ws_handshakes[-1]
    assert hs["path"] == "/ws"
    h = hs["headers"]
    assert h["host"] == [f"127.0.0.1:{env.proxy_port}"]
    assert h["x-custom"] == ["v"]
    assert h["origin"] == ["http://example.com"]
    assert "e2b-sandbox-id" not in h and "e2b-sandbox-port" not in h
    assert h["sec-websocket-protocol"] == ["chat.v2, chat.v1"]


async def test_websocket_client_close_reaches_sandbox(env: Env) -> None:
    env.upstream.ws_closed.clear()
    env.upstream.ws_close.clear()
    host = f"49983-sbx1.localhost:{env.proxy_port}"
    async with ws_connect(
        f"ws://127.0.0.1:{env.proxy_port}/ws", additional_headers={"host": host}, proxy=None
    ) as ws:
        await ws.send(b"\x00\x01")
        assert await ws.recv() == b"\x00\x01"
        await ws.close(4002, "client bye")
    await asyncio.wait_for(env.upstream.ws_closed.wait(), 5)
    assert env.upstream.ws_close == [(4002, "client bye")]
    assert env.resolved[-1] == ("sbx1", 49983)


async def test_websocket_errors(env: Env) -> None:
    base = f"ws://127.0.0.1:{env.proxy_port}"
    for sid, status in (("missing", 502), ("paused", 502), ("dead", 502)):
        with pytest.raises(InvalidStatus) as info:
            await ws_connect(f"{base}/ws", additional_headers={"e2b-sandbox-id": sid}, proxy=None)
        response = info.value.response
        assert response.status_code == status
        assert json.loads(response.body or b"")["code"] == status
    with pytest.raises(InvalidStatus) as info:
        await ws_connect(f"{base}/proxy/ws", proxy=None)
    assert info.value.response.status_code == 400
    # the sandbox's own refusal is passed on
    with pytest.raises(InvalidStatus) as info:
        await ws_connect(f"{base}/ws-deny", additional_headers=ENVD, proxy=None)
    assert info.value.response.status_code == 403
    assert info.value.response.body == b"nope"
    assert info.value.response.headers["x-why"] == "policy"


async def test_drop_breaks_off_streams_in_flight(env: Env) -> None:
    """What the node does when a sandbox is killed: a response streaming from it ends at once
    (the client's connection is reset: clients read that as the connection lost and probe
    the sandbox, where a clean close would read as a malformed body), a WebSocket gets
    an abnormal close, and the next request opens a fresh connection."""
    victim = {"e2b-sandbox-id": "victim", "e2b-sandbox-port": "49983"}
    async with env.client() as c, c.stream("GET", "/hang", headers=victim) as r:
        chunks = r.aiter_raw()
        assert await anext(chunks) == b"tick\n"
        env.router.drop("victim")
        with pytest.raises(httpx.ReadError):
            await asyncio.wait_for(anext(chunks), 5)
    await asyncio.wait_for(env.upstream.hang_disconnected.wait(), 5)
    env.upstream.hang_disconnected.clear()

    url = f"ws://127.0.0.1:{env.proxy_port}/ws"
    async with ws_connect(url, additional_headers=victim, proxy=None) as ws:
        await ws.send("ping")
        assert await ws.recv() == "ping"
        env.router.drop("victim")
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 5)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1014

    async with env.client() as c:
        r = await c.get("/health", headers=victim)
    assert r.status_code == 200
