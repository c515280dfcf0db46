"""The proxy's on-demand port forwards: a port found refused is offered to `expose` (the
node asks the sandbox's envd to forward a loopback-only listener) and tried once more when
that says it now may answer; envd's own port never is."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from aenv.domain import ENVD_PORT, Upstream
from aenv.proxy import SandboxRouter
from tests.helpers import async_wait_until, free_port, uvicorn_task


async def _sandbox_app(scope: Any, receive: Any, send: Any) -> None:
    """Plays the process in the sandbox: answers HTTP and echoes one WebSocket message."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"from the loopback server"})
    elif scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.accept"})
        msg = await receive()
        await send({"type": "websocket.send", "text": "echo:" + msg.get("text", "")})
        await send({"type": "websocket.close"})


async def _control(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the control app is not part of this test")


class Sandbox:
    """A port nobody listens on until `expose` is asked for it (when `listens`)."""

    def __init__(self, listens: bool) -> None:
        self.port = free_port()
        self.listens = listens
        self.asked: list[tuple[str, int]] = []
        self.server: uvicorn.Server | None = None
        self.task: asyncio.Future[None] | None = None

    async def resolve(self, sandbox_id: str, port: int, token: str | None) -> Upstream:
        return Upstream("127.0.0.1", self.port)

    async def expose(self, sandbox_id: str, port: int) -> bool:
        self.asked.append((sandbox_id, port))
        if not self.listens:
            return False
        if self.server is None:
            config = uvicorn.Config(
                _sandbox_app, host="127.0.0.1", port=self.port, lifespan="off", log_level="warning"
            )
            server = self.server = uvicorn.Server(config)
            self.task = asyncio.ensure_future(server.serve())
            await async_wait_until(lambda: server.started, what="the loopback server")
        return True

    async def close(self) -> None:
        if self.server is not None and self.task is not None:
            self.server.should_exit = True
            await asyncio.wait_for(self.task, 10)


@contextlib.asynccontextmanager
async def proxy(sandbox: Sandbox) -> AsyncIterator[str]:
    router = SandboxRouter(_control, sandbox.resolve, ["localhost"], expose=sandbox.expose)
    try:
        async with uvicorn_task(router, lifespan="off") as port:
            yield f"127.0.0.1:{port}"
    finally:
        await router.aclose()
        await sandbox.close()


async def test_a_refused_port_is_exposed_and_tried_again() -> None:
    box = Sandbox(listens=True)
    async with proxy(box) as addr, httpx.AsyncClient(trust_env=False) as c:
        r = await c.get(f"http://{addr}/", headers={"Host": "3000-sbx1.localhost"})
        assert (r.status_code, r.text) == (200, "from the loopback server")
        again = await c.get(f"http://{addr}/", headers={"Host": "3000-sbx1.localhost"})
        assert again.status_code == 200
    assert box.asked == [("sbx1", 3000)]  # asked once: then it answered


async def test_a_refused_websocket_port_is_exposed_and_tried_again() -> None:
    box = Sandbox(listens=True)
    async with (
        proxy(box) as addr,
        ws_connect(f"ws://{addr}/", additional_headers={"Host": "3001-sbx1.localhost"}) as ws,
    ):
        await ws.send("hi")
        assert await asyncio.wait_for(ws.recv(), 10) == "echo:hi"
    assert box.asked == [("sbx1", 3001)]


async def test_a_port_nobody_listens_on_stays_a_502() -> None:
    box = Sandbox(listens=False)
    async with proxy(box) as addr, httpx.AsyncClient(trust_env=False) as c:
        r = await c.get(f"http://{addr}/", headers={"Host": "3000-sbx1.localhost"})
        assert r.status_code == 502
        assert r.json()["message"] == "The sandbox is running but port is not open"
        env = await c.get(f"http://{addr}/health", headers={"e2b-sandbox-id": "sbx1"})
        assert env.status_code == 502
        with pytest.raises(InvalidStatus):
            async with ws_connect(
                f"ws://{addr}/", additional_headers={"Host": "3001-sbx1.localhost"}
            ):
                pass
    assert box.asked == [("sbx1", 3000), ("sbx1", 3001)]  # never envd's port
    assert ENVD_PORT not in [p for _, p in box.asked]
