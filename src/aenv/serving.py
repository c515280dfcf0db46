"""Serving one port with uvicorn, for a node and a gateway alike: the TLS files checked at
start-up, the server loop's own wake-ups kept few, asyncio's child processes waited for on
the loop, and the one lifespan that starts and closes a process's parts.

A stop (SIGTERM, Ctrl-C) goes: the parts' `stopping` work while the port still serves (a
cluster node's drain), then uvicorn's stop, which waits for the requests in flight at most
`stop_grace_seconds` (an open command stream or PTY never ends on its own), then the parts'
`close` in reverse order."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any, Protocol, runtime_checkable

import uvicorn
from starlette.types import ASGIApp

from .config import Settings
from .errors import AenvError

log = logging.getLogger("aenv.server")


def check_tls(settings: Settings) -> None:
    """Loads the certificate and key once now, so a wrong path or a key that does not fit
    the certificate is one clear line at start-up, not a traceback from uvicorn."""
    if settings.tls_cert is None or settings.tls_key is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            settings.tls_cert, settings.tls_key
        )
    except (OSError, ssl.SSLError) as exc:
        raise AenvError(
            f"cannot use AENV_TLS_CERT={settings.tls_cert} with AENV_TLS_KEY={settings.tls_key}: "
            f"{getattr(exc, 'strerror', None) or exc}"
        ) from None


def watch_children_by_pidfd() -> None:
    """Has asyncio wait for its child processes (runsc commands) through pidfds on the
    running loop, as Python 3.12 does by default, instead of 3.11's thread per child: each
    command's start cost the loop a thread start and GIL hand-offs (seen in a profile under
    rollouts). Left as it is where the kernel or Python lacks pidfds."""
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return
    watcher = asyncio.PidfdChildWatcher()
    watcher.attach_loop(asyncio.get_running_loop())
    asyncio.set_child_watcher(watcher)


class QuietServer(uvicorn.Server):
    """uvicorn, waking once a second instead of ten times to see whether to stop: an idle
    node's own CPU is a cost per node (a stop is noticed within a second). `stopping` runs
    first when told to stop, while the port still serves (`Parts.stopping`)."""

    def __init__(
        self, config: uvicorn.Config, stopping: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        super().__init__(config)
        self._stopping = stopping

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._stopping is not None:
            await self._stopping()
        cut = _GraceCut()
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.addFilter(cut)
        try:
            await super().shutdown(sockets)
        finally:
            uvicorn_log.removeFilter(cut)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        watch_children_by_pidfd()
        await super().serve(sockets)

    async def main_loop(self) -> None:
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000  # on_tick's once-a-second work, every tick
            await asyncio.sleep(1.0)
            should_exit = await self.on_tick(counter)


class _GraceCut(logging.Filter):
    """uvicorn logs each request it cancels at the end of a stop's grace as an error with a
    traceback. Cutting a stream that would never end is the plan there, so its own summary,
    as one warning, says it all."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError):
            return False
        if isinstance(record.msg, str) and record.msg.startswith("Cancel %s running task(s)"):
            record.msg = "cut %s request(s) still open at the end of the stop's grace"
            record.msg += " (AENV_STOP_GRACE_SECONDS)"
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def uvicorn_config(app: ASGIApp, settings: Settings, ws_options: dict[str, Any]) -> uvicorn.Config:
    """How a node and a gateway serve their one port (`ws_options`: the proxy's bounds on
    a client's websocket, `proxy.ws.SERVER_OPTIONS`)."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        # uvicorn's own lines go through the process's handler (`logctx.configure`), so
        # `AENV_LOG_FORMAT=json` holds for them too.
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_keep_alive=75,
        timeout_graceful_shutdown=settings.stop_grace_seconds,
        # The proxy passes the sandbox's own headers through; uvicorn must not add a second set.
        server_header=False,
        date_header=False,
        ssl_certfile=settings.tls_cert,
        ssl_keyfile=settings.tls_key,
        **ws_options,
    )


Lifespan = Callable[[Any], AbstractAsyncContextManager[None]]


class Part(Protocol):
    """What a process starts before it serves and closes after (the orchestrator, the
    builder, the cluster agent...)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class StopsFirst(Protocol):
    """A part with work to do as soon as its process is told to stop, while the port still
    serves: a cluster node drains its sandboxes then (which ends their streams) rather than
    after every open connection ended."""

    async def stopping(self) -> None: ...


class Parts:
    """A process's parts as its one ASGI lifespan (`parts(app)`): started in order, closed
    in reverse; a start that fails closes those already started. `stopping` is for the
    server to call at a stop, before it waits for the requests in flight."""

    def __init__(self, *parts: Part) -> None:
        self.parts = parts

    @asynccontextmanager
    async def __call__(self, _app: Any) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            for part in self.parts:
                await part.start()
                stack.push_async_callback(part.close)
            yield

    async def stopping(self) -> None:
        for part in reversed(self.parts):
            if isinstance(part, StopsFirst):
                try:
                    await part.stopping()
                except Exception:
                    log.exception("%s failed at the stop", type(part).__name__)
