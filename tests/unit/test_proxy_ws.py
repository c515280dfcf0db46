"""The data-plane proxy's WebSocket forwarding, against real servers on loopback
(tests/unit/proxy_env.py): text, binary and the upstream's close echoed, the client's close
reaching the sandbox, refused upgrades, and streams broken off when the sandbox is dropped.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio
import websockets
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.unit.proxy_env import ENVD, Env, proxy_servers

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env() -> AsyncIterator[Env]:
    async with proxy_servers() as value:
        yield value


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
