"""A fake internet for egress tests: a network namespace of the test's own, joined to the host
by a veth pair on a documentation range, answering HTTP on two documentation addresses.
Nothing outside this machine is touched; every part is removed by name afterwards."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import time
from collections.abc import Iterator

NET_HOST, NET_PEER, TARGETS = "192.0.2.1", "192.0.2.2", "203.0.113.0/24"
A, B, PORT = "203.0.113.10", "203.0.113.20", 8080

LISTENER = """
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080)); s.listen(64)
def serve(c):
    try:
        c.settimeout(2); c.recv(1024)
        body = ("ext " + c.getsockname()[0] + "\\n").encode()
        c.sendall(b"HTTP/1.0 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body) + body)
    finally:
        c.close()
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""


@contextlib.contextmanager
def fake_internet() -> Iterator[None]:
    """Up for the duration of the context; names unique per run."""
    tok = secrets.token_hex(3)
    ns, veth = f"aeegx-{tok}", f"aeegx{tok}"
    setup = f"""set -e
ip netns add {ns}
ip link add {veth} type veth peer name eth0 netns {ns}
ip addr add {NET_HOST}/30 dev {veth}; ip link set {veth} up
ip -n {ns} addr add {NET_PEER}/30 dev eth0; ip -n {ns} link set eth0 up
ip -n {ns} link set lo up
ip -n {ns} addr add {A}/32 dev lo; ip -n {ns} addr add {B}/32 dev lo
ip route add {TARGETS} via {NET_PEER} dev {veth}
"""
    proc = None
    try:
        subprocess.run(["sh", "-c", setup], check=True)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, "python3", "-c", LISTENER], stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while not all(b"ext " in host_get(ip, PORT) for ip in (A, B)):
            assert time.monotonic() < deadline, "the fake internet does not answer"
            time.sleep(0.05)
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "route", "del", TARGETS, "dev", veth], capture_output=True)
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def host_get(ip: str, port: int) -> bytes:
    """An HTTP/1.0 GET from the host (busybox nc), the raw answer or b""."""
    cmd = f"printf 'GET /\\r\\n' | busybox nc -w 1 {ip} {port}"
    return subprocess.run(["sh", "-c", cmd], capture_output=True).stdout
