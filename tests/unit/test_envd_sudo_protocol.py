"""envd's sudo service through a terminal and on the wire: an interactive shell in a pty, the
terminal restored afterwards, and the building blocks (argument parsing, frames, shell quoting,
the exec plan, identity from SCM credentials, the raw protocol). The service runs as in
tests/unit/test_envd_sudo.py, from tests/unit/sudo_env.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import shutil
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.envd import sudo_args, sudo_plan, sudo_protocol, sudo_service
from aenv.envd.state import User, Users
from tests.helpers import wait_until
from tests.unit.sudo_env import ALICE, BOB, LOADER, SYSTEM_PY, Env, sudo_env

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0
    or not SYSTEM_PY.exists()
    or not LOADER.exists()
    or shutil.which("setpriv") is None,
    reason="needs root, setpriv, /usr/bin/python3.11 and the x86-64 loader",
)


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with sudo_env() as value:
        yield value


# --- a terminal --------------------------------------------------------------------------------


class Pty:
    """The client in a session of its own with a pty as controlling terminal."""

    def __init__(self, env: Env, *args: str, uid: int | None = None) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 111, 0, 0))

        def ctty() -> None:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(
            env.argv(*args, uid=uid),
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env.env(),
            cwd=env.root,
            start_new_session=True,
            preexec_fn=ctty,
        )
        os.close(slave)
        self.buf = b""

    def expect(self, needle: bytes, timeout: float = 10) -> bytes:
        deadline = time.monotonic() + timeout
        while needle not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{needle!r} not in {self.buf[-2000:]!r}")
            r, _, _ = select.select([self.master], [], [], left)
            if r:
                try:
                    data = os.read(self.master, 65536)
                except OSError:
                    data = b""
                if not data:
                    raise AssertionError(f"EOF before {needle!r}: {self.buf[-2000:]!r}")
                self.buf += data
        out, _, self.buf = self.buf.partition(needle)
        return out + needle

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.master)


def test_interactive_shell_in_a_pty(env: Env) -> None:
    t = Pty(env, "bash", "--norc", "--noprofile", "-i", uid=ALICE)
    try:
        t.send(b"PS1='<$?># '\n")
        t.expect(b"<0># ")
        t.send(b"id -u; tty; stty size\n")
        out = t.expect(b"<0># ").decode()
        assert "\r0\r\n/dev/pts/" in out and "33 111" in out
        # job control works: a background job, a foreground one stopped and resumed
        t.send(b"sleep 30 & jobs\n")
        assert b"Running" in t.expect(b"<0># ")
        t.send(b"kill %1; wait\n")
        t.expect(b"# ")
        # ^C reaches the foreground job inside, the shell stays
        t.send(b"sh -c 'echo rea''dy; exec sleep 30'\n")
        t.expect(b"ready\r\n")
        t.send(b"\x03")
        t.expect(b"<130># ")
        # window size changes are passed on
        fcntl.ioctl(t.master, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        t.proc.send_signal(signal.SIGWINCH)

        def resized() -> bool:
            t.send(b"stty size\n")
            return b"40 120" in t.expect(b"<0># ")

        wait_until(resized, 10, 0.05, "the new window size inside")
        t.send(b"exit 4\n")
        assert t.proc.wait(10) == 4
        assert b"no job control" not in t.buf
    finally:
        t.close()


def test_pty_output_and_terminal_restored(env: Env) -> None:
    t = Pty(env, "sh", "-c", "test -t 0 && test -t 1 && echo tty-ok; exit 3")
    try:
        t.expect(b"tty-ok\r\n")
        assert t.proc.wait(10) == 3
        attrs = termios.tcgetattr(t.master)
        assert attrs[3] & termios.ICANON and attrs[3] & termios.ECHO  # cooked again
    finally:
        t.close()


# --- building blocks ---------------------------------------------------------------------------


def test_parse_args() -> None:
    o = sudo_args.parse_args(["-nu", "bob", "-E", "A=1", "ls", "-l", "B=2"])
    assert (o.user, o.preserve_env, o.assign, o.command) == (
        "bob",
        True,
        {"A": "1"},
        ["ls", "-l", "B=2"],
    )
    o = sudo_args.parse_args(["--user=x", "--preserve-env=A,B", "-H", "--", "-x"])
    assert (o.user, o.keep, o.set_home, o.command) == ("x", ["A", "B"], True, ["-x"])
    o = sudo_args.parse_args(["-i"])
    assert o.login and o.command == []
    assert sudo_args.parse_args(["-k"]).mode == "kill"
    assert sudo_args.parse_args(["-l", "ls"]).mode == "list"
    with pytest.raises(sudo_args.UsageError):
        sudo_args.parse_args(["-b", "x"])
    with pytest.raises(sudo_args.UsageError):
        sudo_args.parse_args(["--login=3"])


def test_frames() -> None:
    buf = bytearray(
        sudo_protocol.encode_frame({"a": 1}) + sudo_protocol.encode_frame({"b": [2]})[:5]
    )
    assert sudo_protocol.take_frames(buf) == [{"a": 1}]
    assert len(buf) == 5
    buf += sudo_protocol.encode_frame({"b": [2]})[5:]
    assert sudo_protocol.take_frames(buf) == [{"b": [2]}] and not buf
    with pytest.raises(sudo_protocol.FrameError):
        sudo_protocol.take_frames(bytearray(struct.pack(">I", sudo_protocol.MAX_FRAME + 1)))


def test_shell_quote() -> None:
    assert sudo_plan.shell_quote_sudo(["echo", "a b", "$HOME", "x;y"]) == ("echo a\\ b $HOME x\\;y")


def test_plan(tmp_path: Path) -> None:
    (tmp_path / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n"
    )
    (tmp_path / "group").write_text("root:x:0:\nsudo:x:27:user\nuser:x:1000:\n")
    from aenv.envd.state import State

    st = State()
    st.users = Users(str(tmp_path / "passwd"), str(tmp_path / "group"))
    req = {"argv": ["ls"], "env": {"TERM": "x", "FOO": "1"}, "cwd": "/tmp", "tty": False}
    p = sudo_plan.plan(st.users, req, 1000, 1000)
    assert (p.uid, p.gid, p.groups, p.cwd, p.executable) == (0, 0, [0], "/tmp", shutil.which("ls"))
    assert "FOO" not in p.env and p.env["SUDO_USER"] == "user"
    p = sudo_plan.plan(st.users, {**req, "user": "user", "login": True, "argv": []}, 0, 0)
    assert (p.uid, p.gid, p.argv, p.executable) == (1000, 1000, ["-bash"], "/bin/bash")
    assert p.groups == [1000, 27]
    with pytest.raises(sudo_plan.Refused):
        sudo_plan.authorize(st.users, 4242, 4242)
    sudo_plan.authorize(st.users, 1000, 1000)
    assert isinstance(st.users.by_uid(1000), User) and st.users.group_gid("sudo") == 27
    # off unless configured (envd's __main__ sets it in a sandbox only)
    assert sudo_service.start_service(st, {}) is None
    assert sudo_service.start_service(st, {sudo_protocol.SOCKET_ENV: "off"}) is None


def test_identity_comes_from_scm_credentials(env: Env) -> None:
    """envd trusts the kernel-checked SCM_CREDENTIALS, nothing else: root may claim bob's
    uid (CAP_SETUID), and is then refused as bob; no credentials at all are refused too."""
    import socket

    def ask(creds: tuple[int, int, int] | None) -> dict[str, object]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(env.sock))
            req = {"v": sudo_protocol.PROTOCOL, "op": "check"}
            anc = []
            if creds is not None:
                anc.append(
                    (socket.SOL_SOCKET, sudo_protocol.SCM_CREDENTIALS, struct.pack("3i", *creds))
                )
            s.sendmsg([sudo_protocol.encode_frame(req)], anc)
            buf = bytearray()
            while not (frames := sudo_protocol.take_frames(buf)):
                chunk = s.recv(4096)
                assert chunk
                buf += chunk
            return frames[0]

    assert ask((os.getpid(), 0, 0))["ok"] is True
    assert ask((os.getpid(), ALICE, ALICE))["user"] == "alice"
    assert ask((os.getpid(), BOB, BOB))["error"] == "bob is not in the sudoers file."
    # Linux attaches the sender's real credentials when none are sent (root here)
    reply = ask(None)
    assert reply.get("ok") is True or "credentials" in str(reply.get("error"))


def test_raw_protocol(env: Env) -> None:
    """The wire protocol by hand: request + credentials + fds, started, winch, signal, exit."""
    import socket

    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    script = "trap 'echo winch' WINCH; trap 'exit 9' TERM; echo up; while :; do sleep 0.05; done"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(env.sock))
        req = {
            "v": sudo_protocol.PROTOCOL,
            "op": "run",
            "argv": ["sh", "-c", script],
            "env": {"PATH": "/usr/bin:/bin"},
            "cwd": "/",
        }
        creds = struct.pack("3i", os.getpid(), ALICE, ALICE)
        s.sendmsg(
            [sudo_protocol.encode_frame(req)],
            [
                (socket.SOL_SOCKET, sudo_protocol.SCM_CREDENTIALS, creds),
                (socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("3i", in_r, out_w, out_w)),
            ],
        )
        for fd in (in_r, out_w):
            os.close(fd)
        buf = bytearray()

        def reply() -> dict[str, object]:
            while not (frames := sudo_protocol.take_frames(buf)):
                chunk = s.recv(4096)
                assert chunk
                buf.extend(chunk)
            return frames[0]

        started = reply()
        pid = started["started"]
        assert isinstance(pid, int)
        with os.fdopen(out_r, "rb", buffering=0) as out:
            assert out.readline() == b"up\n"
            s.sendall(sudo_protocol.encode_frame({"winch": True}))
            assert out.readline() == b"winch\n"
            s.sendall(sudo_protocol.encode_frame({"signal": int(signal.SIGTERM)}))
            assert reply() == {"exit": 9, "signal": None}
    os.close(in_w)
