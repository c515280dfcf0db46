"""Helpers every test suite shares (unit, integration): loopback ports, waiting for a
condition, serving a fake or an ASGI app on loopback. Imported as `tests.helpers` (pytest
runs from the repository root, and `tests/` is a package).

Waits poll a condition until a deadline, which only bounds how long a broken run hangs: no
test asserts how fast something happened (timing goals live in bench/).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn

from aenv.cluster.state import ClusterState

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

T = TypeVar("T")


def loopback_socket() -> socket.socket:
    """A TCP socket bound to a free port on 127.0.0.1, for a server to listen on.

    proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on accepted sockets whose proto
    says TCP, and without it every small response pays Nagle + delayed ACK (~40 ms)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (a server may take it, or a test may
    count on a refused connection)."""
    with loopback_socket() as sock:
        return int(sock.getsockname()[1])


def wait_until(
    condition: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, what: str = ""
) -> T:
    """The first truthy value of `condition()`, polled every `interval` seconds; an
    AssertionError naming `what` when none came within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what or condition}")
        time.sleep(interval)


async def async_wait_until(
    condition: Callable[[], T | Awaitable[T]],
    timeout: float = 10.0,
    interval: float = 0.01,
    what: str = "",
) -> T:
    """`wait_until` on the event loop; `condition` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what or condition}")
        await asyncio.sleep(interval)


def wait_healthy(
    url: str,
    timeout: float = 10.0,
    proc: subprocess.Popen[Any] | None = None,
    path: str = "/health",
    status: int | tuple[int, ...] = 204,
    log: Path | None = None,
) -> None:
    """Until `url + path` answers `status` (envd, the aenv server, moto, a registry).
    With `proc`: fails as soon as that process exits instead of waiting out the timeout;
    with `log`: the failure shows the end of that file (the server's own account)."""

    ok = (status,) if isinstance(status, int) else status

    def healthy() -> bool:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{url}: the server exited with {proc.returncode}")
        try:
            return httpx.get(url + path, timeout=1).status_code in ok
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, timeout, 0.05, f"{url}{path} to answer {'/'.join(map(str, ok))}")
    except AssertionError as e:
        if log is None:
            raise
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"
        raise AssertionError(f"{e}\n{tail}") from None


@contextlib.contextmanager
def http_server_thread(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A stdlib HTTP server (one thread per request) on a free loopback port, for fakes
    written as request handlers; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def uvicorn_thread(app: Any, **config: Any) -> Iterator[str]:
    """`app` served by uvicorn in a thread on a free loopback port; yields its base URL."""
    sock = loopback_socket()
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), what="uvicorn to start")
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextlib.asynccontextmanager
async def uvicorn_task(app: Any, **config: Any) -> AsyncIterator[int]:
    """`app` served by uvicorn on the running event loop, on a free loopback port; yields
    the port."""
    sock = loopback_socket()
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))

    def started() -> bool:
        if task.done():
            task.result()  # uvicorn failed: its error, not a timeout
        return bool(server.started)

    try:
        await async_wait_until(started, what="uvicorn to start")
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


class RedisServer:
    """A real `redis-server` on a free loopback port, without persistence (a restart loses
    everything, the worst case the cluster must survive), with `password` if given (then in
    `url` too); stopped by its pid."""

    def __init__(self, workdir: Path, password: str | None = None) -> None:
        self.port = free_port()
        self.password = password
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

        def up() -> bool:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1) as s,
            ):
                if self.password:
                    s.sendall(f"AUTH {self.password}\r\n".encode())
                    if not s.recv(16).startswith(b"+OK"):
                        return False
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
            return False

        wait_until(up, 15, 0.05, "redis-server to answer")

    def stop(self, sig: int = 15) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[RedisServer]:
    srv = RedisServer(workdir)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


async def heard_ago(state: ClusterState, node_id: str, seconds: float) -> None:
    """Backdates when Redis took node `node_id`'s last heartbeat, by Redis's clock: as if the
    node had stopped heartbeating `seconds` ago."""
    secs, micros = await state.redis.time()
    await state.redis.hset(f"{state.ns}:seen", node_id, str(secs + micros / 1e6 - seconds))
