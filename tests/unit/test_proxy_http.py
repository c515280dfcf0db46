"""The data-plane proxy's HTTP semantics, against real servers on loopback
(tests/unit/proxy_env.py): HEAD, 204 and redirects, pooled keep-alive connections and their
drop, streamed bodies both ways, chunked and late bodies, client disconnects, large bodies,
stale pooled connections retried, and upstreams that answer oddly, break off or send garbage.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import ssl
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from aenv.domain import Upstream
from aenv.proxy import ConnectionPool, HttpForwarder, SandboxRouter
from aenv.proxy._common import canonical_name
from aenv.telemetry import HttpMetrics, HttpMetricsMiddleware
from tests.helpers import uvicorn_task
from tests.tls import TlsFiles, make_certs
from tests.unit.proxy_env import ENVD, Env, MiB, _no_control_app, _pattern, proxy_servers, serve

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env() -> AsyncIterator[Env]:
    async with proxy_servers() as value:
        yield value


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


async def test_header_names_reach_the_sandbox_in_canonical_case() -> None:
    """As E2B's (Go) proxy writes them: an app printing its request headers sees `Host`."""
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            heads.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def resolver(sandbox_id: str, p: int, token: str | None) -> Upstream:
        return Upstream("127.0.0.1", port)

    router = SandboxRouter(_no_control_app, resolver, [])
    try:
        async with serve(router) as proxy_port, httpx.AsyncClient(trust_env=False) as c:
            r = await c.get(
                f"http://127.0.0.1:{proxy_port}/",
                headers={"e2b-sandbox-id": "s", "x-test-TOKEN": "v", "content-type": "a/b"},
            )
        assert r.status_code == 204
    finally:
        await router.aclose()
        server.close()
    lines = heads[0].decode().split("\r\n")[1:]
    names = {line.partition(":")[0] for line in lines if line}
    assert {"Host", "X-Test-Token", "Content-Type", "Accept"} <= names, names
    assert canonical_name(b"www-authenticate") == b"Www-Authenticate"
    assert canonical_name(b"bad name") == b"bad name"


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
async def test_an_upstream_reset_mid_body_resets_the_client(tls: bool, tmp_path: Path) -> None:
    """An upstream that resets its connection mid-body (a node behind a gateway whose sandbox
    was killed mid-stream) resets the client's too, not a clean close: the SDKs read a reset
    as the connection lost, then probe the sandbox and report it killed. The server logs no
    error for it (over TLS the reset reaches it a few loop turns later)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
            await asyncio.sleep(0.2)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def resolver(sandbox_id: str, p: int, token: str | None) -> Upstream:
        return Upstream("127.0.0.1", port)

    router = SandboxRouter(_no_control_app, resolver, [])
    # As a node and a gateway serve it: behind the metrics middleware, which wraps `send`.
    app = HttpMetricsMiddleware(router, HttpMetrics(CollectorRegistry()))
    certs = make_certs(tmp_path) if tls else None
    tls_config = {} if certs is None else {"ssl_certfile": certs.cert, "ssl_keyfile": certs.key}
    errors = _Errors()
    logging.getLogger("uvicorn.error").addHandler(errors)
    try:
        async with (
            uvicorn_task(app, server_header=False, date_header=False, **tls_config) as proxy_port,
            httpx.AsyncClient(trust_env=False, verify=_trusting(certs)) as c,
        ):
            url = f"{'https' if tls else 'http'}://127.0.0.1:{proxy_port}/"
            async with c.stream("GET", url, headers={"e2b-sandbox-id": "s"}) as r:
                got = b""
                with pytest.raises(httpx.ReadError) as ei:
                    async for part in r.aiter_raw():
                        got += part
                # A clean close would be httpx.RemoteProtocolError (an incomplete body).
                assert got == b"hello" and not isinstance(ei.value, httpx.RemoteProtocolError)
            await asyncio.sleep(0.3)  # the server has finished with the request
    finally:
        logging.getLogger("uvicorn.error").removeHandler(errors)
        await router.aclose()
        server.close()
    assert errors.lines == []


def _trusting(certs: TlsFiles | None) -> ssl.SSLContext | bool:
    return True if certs is None else ssl.create_default_context(cafile=str(certs.ca))


class _Errors(logging.Handler):
    """What a logger says at ERROR or above."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
