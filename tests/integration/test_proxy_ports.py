"""A user app inside a sandbox, served through the node's single port (HTTP and WebSocket)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import websockets
from e2b import Sandbox

from tests.helpers import wait_until

from .conftest import Server
from .helpers import WS_ECHO_SERVER, wait_port

pytestmark = pytest.mark.integration


@pytest.fixture
def app_sbx(sandboxes: list[object]) -> Sandbox:
    s = Sandbox.create(template="base", timeout=120)
    sandboxes.append(s)
    s.files.write("/home/user/site/index.html", "hello from the sandbox app\n")
    s.commands.run("cd /home/user/site && python3 -m http.server 8080", background=True)
    s.files.write("/home/user/ws.py", WS_ECHO_SERVER)
    s.commands.run("python3 /home/user/ws.py 8765", background=True)
    wait_port(s, 8080)
    wait_port(s, 8765)
    return s


def test_http_by_headers_and_host(e2b_env: Server, app_sbx: Sandbox) -> None:
    sid = app_sbx.sandbox_id
    r = httpx.get(
        f"{e2b_env.url}/index.html", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8080"}
    )
    assert r.status_code == 200 and r.text == "hello from the sandbox app\n"
    r = httpx.get(f"{e2b_env.url}/index.html", headers={"Host": f"8080-{sid}.localhost"})
    assert r.status_code == 200 and r.text == "hello from the sandbox app\n"
    # E2B's edge answers, both JSON 502s: a port nobody listens on, an unknown sandbox
    r = httpx.get(f"{e2b_env.url}/", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "9"})
    assert r.status_code == 502
    assert r.json()["message"] == "The sandbox is running but port is not open"
    assert r.json()["port"] == 9
    r = httpx.get(
        f"{e2b_env.url}/",
        headers={"E2b-Sandbox-Id": "inosuchsandbox00000", "E2b-Sandbox-Port": "8080"},
    )
    assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"


def test_websocket(e2b_env: Server, app_sbx: Sandbox) -> None:
    async def go() -> None:
        url = e2b_env.url.replace("http://", "ws://") + "/echo"
        hdrs = {"E2b-Sandbox-Id": app_sbx.sandbox_id, "E2b-Sandbox-Port": "8765"}
        async with websockets.connect(url, additional_headers=hdrs) as ws:
            await ws.send("ping text")
            assert await ws.recv() == "ping text"
            await ws.send(b"\x00\x01binary")
            assert await ws.recv() == b"\x00\x01binary"

    asyncio.run(go())


def _listing(url: str, sbx: Sandbox, port: int) -> httpx.Response:
    return httpx.get(f"{url}/", headers={"Host": f"{port}-{sbx.sandbox_id}.localhost"}, timeout=30)


def test_port_bound_to_loopback_is_reachable(e2b_env: Server, sandboxes: list[object]) -> None:
    """A server on 127.0.0.1 inside (a dev server's default) answers through the proxy, as on
    E2B; a fork child's copy too. Once it stops, the port is free again for a server on all
    addresses."""
    s = Sandbox.create(template="base", timeout=120)
    sandboxes.append(s)
    s.files.write("/home/user/lo/only-on-loopback.txt", "x")
    server = s.commands.run(
        "cd /home/user/lo && exec python3 -m http.server --bind 127.0.0.1 8090", background=True
    )
    wait_port(s, 8090)

    def listed(sbx: Sandbox) -> bool:
        r = _listing(e2b_env.url, sbx, 8090)
        return r.status_code == 200 and "only-on-loopback.txt" in r.text

    wait_until(lambda: listed(s), 15, 0.2, "the loopback server through the proxy")
    s.pause()
    s = Sandbox.connect(s.sandbox_id)
    assert listed(s)
    # A fork checkpoints the parent and restores it in place; the child is restored from the
    # same image: both keep their server and its forwarding.
    (child,) = s.fork(count=1)
    assert isinstance(child, Sandbox), child
    sandboxes.append(child)
    wait_until(lambda: listed(child), 15, 0.2, "the fork child's loopback server")
    wait_until(lambda: listed(s), 15, 0.2, "the parent's loopback server after the fork")

    server.kill()
    wait_until(
        lambda: _listing(e2b_env.url, s, 8090).status_code == 502, 15, 0.2, "the port to close"
    )
    s.commands.run(
        "cd /home/user/lo && exec python3 -m http.server --bind 0.0.0.0 8090", background=True
    )
    wait_until(lambda: listed(s), 15, 0.2, "a server on all addresses on the same port")
