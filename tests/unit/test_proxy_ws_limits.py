"""The WebSocket proxy's bounds against real servers on loopback (issue 10, part 8): a message
over the bound from either side closes the socket with 1009 without being buffered, and a
client that does not read holds the sandbox back instead of filling the server's memory.

The "sandbox" is a websockets server with no size limit of its own; the router is served by
uvicorn with the options `aenv server` uses (`SERVER_OPTIONS`), the bound made small."""

from __future__ import annotations

import asyncio
import random
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import pytest_asyncio
from websockets.asyncio.client import connect as ws_connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from aenv.domain import Upstream
from aenv.proxy import SandboxRouter
from aenv.proxy._common import Receive, Scope, Send
from aenv.proxy.ws import SERVER_OPTIONS, WebSocketForwarder
from tests.helpers import async_wait_until, uvicorn_task

pytestmark = pytest.mark.asyncio(loop_scope="session")

MiB = 1 << 20
BOUND = 1 * MiB
HEADERS = {"e2b-sandbox-id": "sbx1", "e2b-sandbox-port": "8080"}
FLOOD_SIZE = 256 * 1024
FLOOD_COUNT = 400  # 100 MiB in all


@dataclass
class Sandbox:
    sent: int = 0  # flood messages the sandbox's app has handed to its socket
    received: list[int] = field(default_factory=list)  # sizes of messages it got
    close_codes: list[int | None] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)


# Incompressible, should the client leg ever negotiate permessage-deflate.
_NOISE = random.Random(0).randbytes(FLOOD_SIZE)


def _flood_message(i: int) -> bytes:
    return struct.pack(">I", i) + _NOISE[4:]


async def _control(scope: Scope, receive: Receive, send: Send) -> None:
    raise AssertionError(f"not routed to the sandbox: {scope.get('path')}")


@dataclass
class Env:
    url: str
    sandbox: Sandbox


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env() -> AsyncIterator[Env]:
    state = Sandbox()

    async def handler(ws: ServerConnection) -> None:
        path = ws.request.path if ws.request else ""
        try:
            if path == "/big":
                await ws.send(b"x" * (3 * BOUND))
            elif path == "/flood":
                for i in range(FLOOD_COUNT):
                    await ws.send(_flood_message(i))
                    state.sent += 1
            async for message in ws:
                state.received.append(len(message))
        except ConnectionClosed:
            pass
        finally:
            await ws.wait_closed()
            state.close_codes.append(ws.close_code)
            state.closed.set()

    async with serve(handler, "127.0.0.1", 0, max_size=None, compression=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]

        async def resolver(sandbox_id: str, p: int, token: str | None) -> Upstream:
            return Upstream("127.0.0.1", port)

        router = SandboxRouter(
            _control, resolver, ["localhost"], ws=WebSocketForwarder(max_size=BOUND)
        )
        options = {**SERVER_OPTIONS, "ws_max_size": BOUND}
        async with uvicorn_task(router, lifespan="off", **options) as proxy_port:
            yield Env(f"ws://127.0.0.1:{proxy_port}", state)


def _reset(state: Sandbox) -> None:
    state.sent = 0
    state.received.clear()
    state.close_codes.clear()
    state.closed.clear()


async def test_oversized_message_from_the_sandbox_closes_with_1009(env: Env) -> None:
    _reset(env.sandbox)
    async with ws_connect(
        f"{env.url}/big", additional_headers=HEADERS, proxy=None, max_size=None
    ) as ws:
        with pytest.raises(ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 10)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1009
    await asyncio.wait_for(env.sandbox.closed.wait(), 10)
    assert env.sandbox.close_codes == [1009]  # the sandbox is told too


async def test_oversized_message_from_the_client_closes_with_1009(env: Env) -> None:
    _reset(env.sandbox)
    async with ws_connect(
        f"{env.url}/echo", additional_headers=HEADERS, proxy=None, max_size=None
    ) as ws:
        await ws.send(b"small")
        await async_wait_until(lambda: env.sandbox.received, what="the small message")
        await ws.send(b"y" * (3 * BOUND))
        with pytest.raises(ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 10)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1009
    await asyncio.wait_for(env.sandbox.closed.wait(), 10)
    assert env.sandbox.received == [5]  # the big one never reached the sandbox


def _small_buffer_socket(url: str) -> socket.socket:
    """A connected client socket with a small receive buffer: what the client itself holds
    does not count toward what the test measures."""
    host, port = url.removeprefix("ws://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.connect((host, int(port)))
    return sock


async def test_a_client_that_does_not_read_holds_the_sandbox_back(env: Env) -> None:
    _reset(env.sandbox)
    async with ws_connect(
        f"{env.url}/flood",
        additional_headers=HEADERS,
        proxy=None,
        max_queue=1,
        compression=None,
        sock=_small_buffer_socket(env.url),
    ) as ws:
        # Not reading: the sandbox's sends stop once the buffers on the way are full.
        last = -1
        while env.sandbox.sent not in (last, FLOOD_COUNT):
            last = env.sandbox.sent
            await asyncio.sleep(0.5)
        in_flight = env.sandbox.sent * FLOOD_SIZE
        # The proxy's own buffers (a few frames and one message per leg) plus the kernel's
        # socket buffers on the way; without backpressure all 100 MiB would be in flight.
        assert env.sandbox.sent < FLOOD_COUNT
        assert in_flight <= 40 * MiB, f"{in_flight / MiB:.1f} MiB sent to a client not reading"
        # Reading again: everything arrives, in order, nothing dropped.
        for i in range(FLOOD_COUNT):
            message = await asyncio.wait_for(ws.recv(), 30)
            assert message == _flood_message(i)
    assert env.sandbox.sent == FLOOD_COUNT
