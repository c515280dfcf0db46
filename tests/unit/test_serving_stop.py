"""A process's stop (`aenv.serving`): its parts' `stopping` runs first, while the port still
answers, and a stream that never ends on its own (a command's output, a PTY) holds the stop
up for `stop_grace_seconds` at most, not forever."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from aenv.config import Settings
from aenv.serving import Parts, QuietServer, uvicorn_config
from tests.helpers import async_wait_until, loopback_socket


class Journal:
    """A part that, at `stopping`, asks its own server for an answer (it must still get
    one) and notes the order of everything."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.lines: list[str] = []

    async def start(self) -> None:
        self.lines.append("start")

    async def stopping(self) -> None:
        async with httpx.AsyncClient() as c:
            r = await c.get(f"{self.url}/ping", timeout=10)
        self.lines.append(f"stopping, still answering: {r.text}")

    async def close(self) -> None:
        self.lines.append("close")


def app_of(parts: Parts) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            async with parts(None):
                await receive()
                await send({"type": "lifespan.startup.complete"})
                await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/ping":
            await send({"type": "http.response.body", "body": b"pong"})
            return
        while True:  # /stream: output that never ends
            await send({"type": "http.response.body", "body": b"tick\n", "more_body": True})
            await asyncio.sleep(0.2)

    return app


async def test_a_stop_runs_stopping_first_and_cuts_endless_streams_after_the_grace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sock = loopback_socket()
    port = int(sock.getsockname()[1])
    url = f"http://127.0.0.1:{port}"
    journal = Journal(url)
    parts = Parts(journal)
    settings = Settings(stop_grace_seconds=1)
    config = uvicorn_config(app_of(parts), settings, {})
    server = QuietServer(config, parts.stopping)
    # QuietServer.serve installs a child watcher on this test's loop, which ends with the
    # test: later tests' subprocesses need the one they had.
    watcher = asyncio.get_child_watcher()
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        await async_wait_until(lambda: bool(server.started), what="uvicorn to start")
        async with httpx.AsyncClient() as c, c.stream("GET", f"{url}/stream") as stream:
            lines = stream.aiter_lines()
            assert await anext(lines) == "tick"
            t0 = time.monotonic()
            server.should_exit = True
            await asyncio.wait_for(task, 30)
            took = time.monotonic() - t0
        assert journal.lines == ["start", "stopping, still answering: pong", "close"]
        # Noticed within QuietServer's second, then the one second of grace.
        assert took < 8, took
        # The cut is one warning, not an error with a traceback per request.
        said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "uvicorn.error"]
        assert said == [
            (
                "WARNING",
                "cut 1 request(s) still open at the end of the stop's grace"
                " (AENV_STOP_GRACE_SECONDS)",
            )
        ], said
    finally:
        server.should_exit = True
        if not task.done():
            task.cancel()
        sock.close()
        asyncio.set_child_watcher(watcher)
