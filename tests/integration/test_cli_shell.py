"""`aenv start`'s interactive shell through a real pseudo-terminal, against a real server:
type a command and see its output, resize the terminal and see the shell's new size, exit
with code 0 and find the terminal's mode as it was."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import termios
import time

import pytest

from .conftest import AENV, Server

pytestmark = pytest.mark.integration


def _set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class Terminal:
    """A pty pair; the CLI runs on the slave as its controlling terminal, the test keeps
    the slave open too, to read its mode while and after the CLI runs."""

    def __init__(self, rows: int = 24, cols: int = 80) -> None:
        self.master, self.slave = os.openpty()
        _set_size(self.master, rows, cols)
        self.out = b""

    def spawn(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        def controlling_tty() -> None:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        return subprocess.Popen(
            args,
            stdin=self.slave,
            stdout=self.slave,
            stderr=self.slave,
            env=env,
            start_new_session=True,
            preexec_fn=controlling_tty,
        )

    def read(self, timeout: float = 0.5) -> None:
        r, _, _ = select.select([self.master], [], [], timeout)
        if r:
            with contextlib.suppress(OSError):
                self.out += os.read(self.master, 65536)

    def read_until(self, marker: bytes, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while marker not in self.out:
            assert time.monotonic() < deadline, self.out[-2000:]
            self.read()

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> None:
        for fd in (self.master, self.slave):
            with contextlib.suppress(OSError):
                os.close(fd)


def _cli_env(server: Server) -> dict[str, str]:
    return dict(os.environ, AENV_URL=server.url, AENV_API_KEY=server.api_key, TERM="xterm")


def _sandbox_ids(server: Server, marker: str) -> list[str]:
    with server.client() as c:
        return [
            s["sandboxID"]
            for s in c.get("/v2/sandboxes").json()
            if s.get("metadata", {}).get("test") == marker
        ]


def test_pty_shell_type_resize_exit_restores_terminal(server: Server) -> None:
    marker = f"pty-{os.getpid()}-{time.monotonic_ns()}"
    term = Terminal(rows=24, cols=80)
    before = termios.tcgetattr(term.slave)
    proc = term.spawn([AENV, "start", "base", "-m", f"test={marker}"], _cli_env(server))
    try:
        term.read_until(b"$ ")
        # Raw mode while attached: no line editing, no local echo.
        lflag = termios.tcgetattr(term.slave)[3]
        assert not lflag & termios.ICANON and not lflag & termios.ECHO

        term.type("echo answer-$((6*7)); stty size\r")
        term.read_until(b"answer-42")
        term.read_until(b"24 80")

        # Resize the terminal (the kernel signals the foreground group), then a burst of
        # SIGWINCH as a window dragged to size sends: signals arriving inside the CLI's own
        # handler must not wedge it.
        _set_size(term.master, 41, 133)
        for i in range(2000):
            os.kill(proc.pid, signal.SIGWINCH)
            time.sleep(i % 7 * 1e-5)
        deadline = time.monotonic() + 30
        while b"41 133" not in term.out:
            assert time.monotonic() < deadline, term.out[-2000:]
            term.type("stty size\r")
            for _ in range(4):
                term.read(0.25)

        term.type("exit\r")
        code = proc.wait(timeout=60)
        term.read(0.1)
        assert code == 0, term.out[-2000:]
        # The terminal is as the CLI found it.
        assert termios.tcgetattr(term.slave) == before
        # The sandbox went with the shell (no --keep).
        assert _sandbox_ids(server, marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        term.close()
        with server.client() as c:
            for sid in _sandbox_ids(server, marker):
                c.delete(f"/sandboxes/{sid}")


def test_pty_shell_exit_code_and_connect_keep(server: Server) -> None:
    """`start --keep` leaves the sandbox; `connect` attaches to it; a shell's exit code is
    the CLI's, and the terminal is restored after a non-zero exit too."""
    marker = f"pty-keep-{os.getpid()}-{time.monotonic_ns()}"
    env = _cli_env(server)
    term = Terminal()
    before = termios.tcgetattr(term.slave)
    sid = ""
    proc = term.spawn([AENV, "start", "--keep", "-m", f"test={marker}"], env)
    try:
        term.read_until(b"$ ")
        term.type("echo kept > /tmp/kept; exit 7\r")
        assert proc.wait(timeout=60) == 7
        assert termios.tcgetattr(term.slave) == before
        [sid] = _sandbox_ids(server, marker)
        term.out = b""
        proc = term.spawn([AENV, "connect", sid], env)
        term.read_until(b"$ ")
        term.type("cat /tmp/kept\r")
        term.read_until(b"kept\r\n")
        term.type("exit\r")
        assert proc.wait(timeout=60) == 0
        assert termios.tcgetattr(term.slave) == before
        info = subprocess.run(
            [AENV, "inspect", sid, "-o", "json"], env=env, capture_output=True, text=True
        )
        assert json.loads(info.stdout)["state"] == "running"  # connect does not remove it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        term.close()
        with server.client() as c:
            for s in _sandbox_ids(server, marker):
                c.delete(f"/sandboxes/{s}")
