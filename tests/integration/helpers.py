"""Small helpers shared by integration tests (the generic ones are in tests/helpers.py)."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2b import Sandbox
from e2b.sandbox.commands.command_handle import PtySize

from tests.helpers import wait_until

# A stdlib-only WebSocket echo server to run inside a sandbox (the base image has python3
# but no third-party packages). Text frames are echoed as text, binary as binary.
WS_ECHO_SERVER = r"""
import base64, hashlib, socket, struct, sys, threading
GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
def recvn(c, n):
    b = b""
    while len(b) < n:
        d = c.recv(n - len(b))
        if not d: raise EOFError
        b += d
    return b
def serve(c):
    req = b""
    while b"\r\n\r\n" not in req:
        req += c.recv(4096)
    key = [l.split(b":", 1)[1].strip() for l in req.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key")][0]
    acc = base64.b64encode(hashlib.sha1(key + GUID.encode()).digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: " + acc + b"\r\n\r\n")
    try:
        while True:
            h = recvn(c, 2); op = h[0] & 0x0F; n = h[1] & 0x7F
            if n == 126: n = struct.unpack(">H", recvn(c, 2))[0]
            elif n == 127: n = struct.unpack(">Q", recvn(c, 8))[0]
            mask = recvn(c, 4) if h[1] & 0x80 else b"\0\0\0\0"
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(recvn(c, n)))
            if op == 8:
                c.sendall(b"\x88\x02" + data[:2]); break
            if op in (1, 2):
                hdr = bytes([0x80 | op])
                hdr += bytes([len(data)]) if len(data) < 126 else b"\x7e" + struct.pack(">H", len(data))
                c.sendall(hdr + data)
    except EOFError:
        pass
    c.close()
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(16)
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def sandbox_record(home: Path, sandbox_id: str) -> dict[str, Any]:
    """A sandbox's record as the node persisted it in its catalog."""
    db = sqlite3.connect(str(home / "catalog.db"))
    try:
        (doc,) = db.execute("SELECT doc FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()
    finally:
        db.close()
    return dict(json.loads(doc))


def sandbox_address(home: Path, sandbox_id: str) -> str:
    """The host-side address of a sandbox, read from the node's catalog."""
    return str(sandbox_record(home, sandbox_id)["instance"]["address"])


def wait_port(sbx: Sandbox, port: int, timeout: float = 15) -> None:
    """Until something listens on `port` inside the sandbox."""
    probe = (
        f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 1)' "
        "&& echo up || true"
    )
    wait_until(
        lambda: "up" in sbx.commands.run(probe).stdout,
        timeout,
        0.2,
        f"port {port} to open in the sandbox",
    )


def assert_kill_ends_streams(s: Sandbox, kill: Callable[[], bool]) -> None:
    """As on E2B: a kill (`kill()`) ends a running command's and a PTY's streams, read
    meanwhile, with the SDK's "killed" error (not a hang until the command would have
    ended), and `is_running()` then says False."""
    cmd = s.commands.run("sleep 600", background=True)
    pty = s.pty.create(PtySize(rows=24, cols=80))
    errors: dict[str, BaseException] = {}
    waiting: set[str] = set()

    def wait(name: str, handle: Any) -> None:
        waiting.add(name)
        try:
            handle.wait()
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertions
            errors[name] = exc

    waiters = [
        threading.Thread(target=wait, args=(n, h), daemon=True)
        for n, h in (("command", cmd), ("pty", pty))
    ]
    for t in waiters:
        t.start()
    # Both streams are being read and both processes run when the kill comes.
    wait_until(
        lambda: (
            waiting == {"command", "pty"}
            and {cmd.pid, pty.pid} <= {p.pid for p in s.commands.list()}
        ),
        30,
        0.05,
        "the command and the PTY to run, their streams read",
    )
    assert kill()
    for t in waiters:
        t.join(60)
    assert not any(t.is_alive() for t in waiters), "a stream outlived its sandbox"
    assert set(errors) == {"command", "pty"}
    for exc in errors.values():
        assert "sandbox was killed or reached its end of life" in str(exc), repr(exc)
    assert not s.is_running()
