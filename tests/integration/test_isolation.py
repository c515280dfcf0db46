"""Sandboxes cannot see each other's files or processes, nor reach the host or each other."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from e2b import Sandbox

from .conftest import Server
from .helpers import sandbox_address, wait_port

pytestmark = pytest.mark.integration

PROBE = (
    "python3 -c 'import socket,sys\n"
    "try:\n"
    '    socket.create_connection((sys.argv[1], int(sys.argv[2])), 2); print("OPEN")\n'
    "except OSError as e:\n"
    '    print("CLOSED", e)\' {host} {port}'
)


def _host_addresses() -> list[str]:
    import subprocess

    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    return [line.split()[3].split("/")[0] for line in out.splitlines()]


@pytest.fixture
def host_listener() -> Iterator[tuple[int, threading.Event]]:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen(8)
    hit = threading.Event()

    def accept() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            hit.set()
            c.close()

    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()[1], hit
    srv.close()


def test_files_and_processes_are_private(sandboxes: list[object]) -> None:
    a = Sandbox.create(template="base", timeout=120)
    b = Sandbox.create(template="base", timeout=120)
    sandboxes += [a, b]
    a.files.write("/tmp/secret-a", "a's secret")
    a.commands.run("sleep 4242", background=True)
    assert not b.files.exists("/tmp/secret-a")
    assert "sleep 4242" not in b.commands.run("ps aux").stdout
    assert "sleep 4242" in a.commands.run("ps aux").stdout


def test_network_isolation(
    e2b_env: Server, sandboxes: list[object], host_listener: tuple[int, threading.Event]
) -> None:
    port, hit = host_listener
    a = Sandbox.create(template="base", timeout=120)
    b = Sandbox.create(template="base", timeout=120)
    sandboxes += [a, b]
    b.commands.run("python3 -m http.server 8000", background=True)
    wait_port(b, 8000)
    # the host's services, on every host address and the sandbox's gateway
    targets = [*_host_addresses(), "169.254.0.22"]
    for host in targets:
        out = a.commands.run(PROBE.format(host=host, port=port)).stdout
        assert out.startswith("CLOSED"), (host, out)
    # the node's API port on loopback is not reachable either
    api_port = int(e2b_env.url.rsplit(":", 1)[1])
    for host in targets:
        out = a.commands.run(PROBE.format(host=host, port=api_port)).stdout
        assert out.startswith("CLOSED"), (host, out)
    assert not hit.is_set()
    # another sandbox's address
    b_addr = sandbox_address(e2b_env.home, b.sandbox_id)
    out = a.commands.run(PROBE.format(host=b_addr, port=8000)).stdout
    assert out.startswith("CLOSED"), out
    # ...while the node itself reaches it
    with socket.create_connection((b_addr, 8000), 2):
        pass
