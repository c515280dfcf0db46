"""envd's privileged exec service and the sudo client, on the host (envd runs as root).

envd runs from a copy of its sources (as the bundle's ``aenv_envd``) with the service socket
and fake /etc/passwd and /etc/group in a world-readable temp dir; the client runs through the
real ``/usr/bin/sudo`` wrapper script, pointed at a fake bundle of symlinks to the host's
python3.11, as root and, under ``setpriv``, as uids that exist only in the fake passwd.
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
import sys
import tempfile
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.envd import sudo, sudo_args, sudo_plan, sudo_protocol, sudo_service
from aenv.envd.state import User, Users
from aenv.runtime.bundle_build import SPAWN_LIB, SPAWN_SOURCE, build_spawn_lib
from tests.helpers import SRC, free_port, wait_healthy, wait_until

SYSTEM_PY = Path("/usr/bin/python3.11")
LOADER = Path("/lib64/ld-linux-x86-64.so.2")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0
    or not SYSTEM_PY.exists()
    or not LOADER.exists()
    or shutil.which("setpriv") is None,
    reason="needs root, setpriv, /usr/bin/python3.11 and the x86-64 loader",
)

ALICE, BOB, CAROL = 65533, 65532, 65531  # sudo member, not a member, primary group sudo
SUDO_GID = 27


class Env:
    def __init__(self, root: Path, sock: Path, shim: Path, proc: subprocess.Popen[bytes]):
        self.root = root
        self.sock = sock
        self.shim = shim
        self.proc = proc

    def argv(self, *args: str, uid: int | None = None, gid: int | None = None) -> list[str]:
        cmd = ["/bin/sh", str(self.shim), *args]
        if uid is None:
            return cmd
        g = uid if gid is None else gid
        return ["setpriv", f"--reuid={uid}", f"--regid={g}", "--clear-groups", *cmd]

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "TERM": "xterm",
            "HOME": "/root",
            sudo_protocol.SOCKET_ENV: str(self.sock),
        }
        env.update(extra)
        return env

    def run(
        self,
        *args: str,
        uid: int | None = None,
        gid: int | None = None,
        input: bytes | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            self.argv(*args, uid=uid, gid=gid),
            input=input,
            capture_output=True,
            env=env or self.env(),
            cwd=self.root,
            timeout=30,
        )
        return subprocess.CompletedProcess(
            r.args, r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode()
        )


def _fake_bundle(b: Path) -> None:
    """What /opt/aenv provides to the wrapper, made of the host's python3.11."""
    (b / "bin").mkdir(parents=True)
    (b / "lib").mkdir()
    (b / "bin/python3").symlink_to(SYSTEM_PY.resolve())
    (b / "lib/ld-linux-x86-64.so.2").symlink_to(LOADER)
    (b / "lib/python3.11").symlink_to("/usr/lib/python3.11")
    shutil.copytree(SRC / "aenv/envd", b / "app/aenv_envd")
    # envd's spawn library, as the bundle has it: commands start through it, not subprocess.
    build_spawn_lib(SRC / "aenv/envd" / SPAWN_SOURCE, b / "lib" / SPAWN_LIB)


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    root = Path(tempfile.mkdtemp(prefix="aenv-sudo-"))
    try:
        root.chmod(0o755)
        _fake_bundle(root / "bundle")
        home = root / "home"
        for name, uid in (("alice", ALICE), ("bob", BOB)):
            (home / name).mkdir(parents=True)
            os.chown(home / name, uid, uid)
        (root / "passwd").write_text(
            "root:x:0:0:root:/root:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
            f"alice:x:{ALICE}:{ALICE}::{home}/alice:/bin/bash\n"
            f"bob:x:{BOB}:{BOB}::{home}/bob:/bin/sh\n"
        )
        (root / "group").write_text(
            f"root:x:0:\nsudo:x:{SUDO_GID}:alice\nalice:x:{ALICE}:\nbob:x:{BOB}:\n"
            "nogroup:x:65534:\nstaff:x:50:bob\n"
        )
        shim = root / "sudo"
        shim.write_text(sudo.SHIM_SCRIPT.replace("b=/opt/aenv", f"b={root}/bundle"))
        shim.chmod(0o755)
        sock = root / "run/sudo.sock"
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "aenv_envd", "--host", "127.0.0.1", "--port", str(port)],
            env={
                "PATH": "/usr/bin:/bin",
                "PYTHONPATH": str(root / "bundle/app"),
                "AENV_ENVD_SUDO_SOCKET": str(sock),
                "AENV_ENVD_PASSWD_FILE": str(root / "passwd"),
                "AENV_ENVD_GROUP_FILE": str(root / "group"),
            },
            cwd="/",
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            # Generous: the host may be busy. The service starts right after the HTTP listener.
            wait_healthy(f"http://127.0.0.1:{port}", timeout=60, proc=proc)
            wait_until(sock.exists, 60, what="the sudo socket")
            yield Env(root, sock, shim, proc)
            proc.terminate()
            proc.wait(30)
            assert not sock.exists()  # removed on shutdown
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --- the service, end to end -----------------------------------------------------------------


def test_socket_mode(env: Env) -> None:
    st = env.sock.stat()
    assert oct(st.st_mode & 0o777) == "0o666" and st.st_uid == 0
    d = env.sock.parent.stat()
    assert oct(d.st_mode & 0o777) == "0o755" and d.st_uid == 0


def test_root_and_exit_codes(env: Env) -> None:
    r = env.run("-n", "id", "-u")
    assert (r.returncode, r.stdout, r.stderr) == (0, "0\n", "")
    assert env.run("sh", "-c", "exit 7").returncode == 7
    assert env.run("false").returncode == 1
    r = env.run("sh", "-c", "echo out; echo err >&2; exit 3")
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
    r = env.run("no-such-command-xyz")
    assert r.returncode == 1 and r.stderr == "sudo: no-such-command-xyz: command not found\n"
    # killed by a signal: the shell sees 128+n
    r = subprocess.run(
        ["/bin/sh", "-c", f"/bin/sh {env.shim} sh -c 'kill -TERM $$'; echo $?"],
        capture_output=True,
        text=True,
        env=env.env(),
        timeout=30,
    )
    assert r.stdout == "143\n"


def test_stdio_pass_through(env: Env) -> None:
    r = env.run("cat", input=b"hi\n")
    assert r.stdout == "hi\n"
    big = os.urandom(3 * 1024 * 1024)
    r2 = subprocess.run(env.argv("cat"), input=big, capture_output=True, env=env.env(), timeout=30)
    assert r2.stdout == big
    r = subprocess.run(
        ["/bin/sh", "-c", f"echo hi | /bin/sh {env.shim} tr a-z A-Z"],
        capture_output=True,
        text=True,
        env=env.env(),
        timeout=30,
    )
    assert r.stdout == "HI\n"
    # a closed stdin is /dev/null for the command (not one of the client's own fds)
    r = subprocess.run(
        ["/bin/sh", "-c", f"/bin/sh {env.shim} sh -c 'cat; echo rc=$?' <&-"],
        capture_output=True,
        text=True,
        env=env.env(),
        timeout=30,
    )
    assert r.stdout == "rc=0\n"
    # the command's stdin/stdout are the caller's own, not copies through envd
    r = env.run("sh", "-c", "readlink /proc/self/fd/1")
    assert r.stdout.startswith("pipe:")


def test_sudo_group_members_only(env: Env) -> None:
    r = env.run("-n", "id", "-u", uid=ALICE)
    assert (r.returncode, r.stdout) == (0, "0\n")
    r = env.run("whoami", uid=ALICE)
    assert r.stdout == "root\n"
    for uid in (BOB, 65534):
        r = env.run("-n", "id", "-u", uid=uid)
        name = {BOB: "bob", 65534: "nobody"}[uid]
        assert r.returncode == 1 and r.stdout == ""
        assert r.stderr == f"{name} is not in the sudoers file.\n"
    # a uid that is in no passwd at all
    r = env.run("true", uid=4242)
    assert r.returncode == 1 and "4242 is not in the sudoers file" in r.stderr
    # the peer's primary group counts too
    assert env.run("id", "-u", uid=BOB, gid=SUDO_GID).stdout == "0\n"
    assert env.run("-v", uid=BOB).returncode == 1
    assert env.run("-v", uid=ALICE).returncode == 0
    r = env.run("-l", uid=ALICE)
    assert r.returncode == 0 and "User alice may run the following commands" in r.stdout


def test_target_user_group_and_login(env: Env) -> None:
    assert env.run("-u", "alice", "id", "-u").stdout == f"{ALICE}\n"
    assert env.run(f"-u#{BOB}", "id", "-u").stdout == f"{BOB}\n"
    r = env.run("-u", "bob", "id", "-G")
    assert set(r.stdout.split()) == {str(BOB), "50"}  # bob's groups from /etc/group
    assert env.run("-u", "alice", "-g", "staff", "id", "-g").stdout == "50\n"
    # -g alone: the invoking user with another primary group
    assert env.run("-g", "staff", "sh", "-c", "id -u; id -g", uid=ALICE).stdout == f"{ALICE}\n50\n"
    r = env.run("-u", "mallory", "true")
    assert r.returncode == 1 and r.stderr == "sudo: unknown user mallory\n"
    r = env.run("-g", "nope", "true")
    assert r.returncode == 1 and r.stderr == "sudo: unknown group nope\n"
    # -i: the target's login shell in its home; -s: $SHELL
    r = env.run("-i", "-u", "alice", "sh", "-c", 'echo "$(pwd) $HOME $USER"; echo $0')
    assert r.stdout == f"{env.root}/home/alice {env.root}/home/alice alice\n-bash\n"
    r = env.run("-s", "echo", "$0", env=env.env(SHELL="/bin/sh"))
    assert r.stdout == "/bin/sh\n"
    # from root to the unprivileged user
    assert env.run("-u", "bob", "sh", "-c", "echo $USER $(id -u)").stdout == f"bob {BOB}\n"
    # the caller's working directory (unless -i / -D)
    assert env.run("pwd").stdout == f"{env.root}\n"
    assert env.run("-D", "/tmp", "pwd").stdout == "/tmp\n"


def test_environment(env: Env) -> None:
    caller = env.env(
        SECRET="x",
        LC_TIME="C",
        PYTHONPATH="/opt/aenv/app",
        PYTHONHOME="/opt/aenv",
        AENV_ENVD_ACCESS_TOKEN="t",
        SUDO_PS1="# ",
        PATH="/evil:/usr/bin",
    )
    out = env.run("env", env=caller, uid=ALICE).stdout
    got = dict(line.split("=", 1) for line in out.splitlines())
    assert "SECRET" not in got and got["LC_TIME"] == "C" and got["TERM"] == "xterm"
    assert got["PATH"] == sudo_protocol.SECURE_PATH and got["PS1"] == "# "
    assert (got["HOME"], got["USER"], got["LOGNAME"], got["SHELL"]) == (
        "/root",
        "root",
        "root",
        "/bin/sh",
    )
    assert (got["SUDO_USER"], got["SUDO_UID"], got["SUDO_GID"]) == ("alice", str(ALICE), str(ALICE))
    assert got["SUDO_COMMAND"] == "/usr/bin/env"
    assert not any(k.startswith(("PYTHON", "AENV_")) for k in got)
    # -E keeps the caller's environment (but not the launcher's PYTHON* variables)
    got = dict(line.split("=", 1) for line in env.run("-E", "env", env=caller).stdout.splitlines())
    assert (
        got["SECRET"] == "x" and got["HOME"] == "/root" and got["PATH"] == sudo_protocol.SECURE_PATH
    )
    assert not any(k.startswith(("PYTHON", "AENV_")) for k in got)
    got = dict(
        line.split("=", 1)
        for line in env.run("--preserve-env=SECRET,PATH", "env", env=caller).stdout.splitlines()
    )
    assert got["SECRET"] == "x" and got["PATH"] == "/evil:/usr/bin"
    # VAR=value before the command
    r = env.run("A=1", "B=two words", "sh", "-c", 'echo "$A $B"')
    assert r.stdout == "1 two words\n"
    # umask: the caller's, at least 022
    r = subprocess.run(
        ["/bin/sh", "-c", f"umask 077; /bin/sh {env.shim} sh -c umask"],
        capture_output=True,
        text=True,
        env=env.env(),
        timeout=30,
    )
    assert r.stdout.strip() == "0077"


def test_cli_errors_and_noops(env: Env) -> None:
    r = env.run("-Z", "true")
    assert r.returncode == 1 and r.stderr.startswith("sudo: invalid option -- 'Z'\nusage: sudo")
    r = env.run("--bogus")
    assert r.returncode == 1 and r.stderr.startswith("sudo: unrecognized option '--bogus'")
    r = env.run("-u")
    assert r.returncode == 1 and "option requires an argument -- 'u'" in r.stderr
    r = env.run()
    assert r.returncode == 1 and r.stderr.startswith("usage: sudo")
    r = env.run("-i", "-s", "true")
    assert r.returncode == 1 and "both the -i and -s" in r.stderr
    r = env.run("-e", "/etc/hosts")
    assert r.returncode == 1 and "not supported" in r.stderr
    assert env.run("-h").stdout.startswith("sudo - execute a command")
    assert env.run("-V").stdout.startswith("Sudo version")
    for args in (["-k"], ["-K"], ["-k", "-n", "true"], ["-nkS", "-p", "pw:", "true"]):
        assert env.run(*args).returncode == 0, args
    assert env.run("--", "id", "-u").stdout == "0\n"
    assert env.run("-l", "ls").stdout.strip().endswith("/ls")


def test_service_unreachable(env: Env) -> None:
    r = env.run("true", env=env.env(AENV_ENVD_SUDO_SOCKET=str(env.root / "nope.sock")))
    assert r.returncode == 1 and "cannot reach the sandbox's privilege service" in r.stderr


# --- signals -----------------------------------------------------------------------------------


def _start_sleeper(env: Env, *args: str) -> tuple[subprocess.Popen[bytes], int]:
    p = subprocess.Popen(
        env.argv(*args, "sh", "-c", "echo $$; exec sleep 60"),
        stdout=subprocess.PIPE,
        env=env.env(),
        cwd=env.root,
    )
    assert p.stdout is not None
    pid = int(p.stdout.readline())
    return p, pid


def _state(pid: int) -> str:
    """The process's state letter (R, S, T, Z...); "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _wait_gone(pid: int) -> None:
    wait_until(lambda: _state(pid) == "", what=f"pid {pid} to be reaped")


def test_signals_are_relayed(env: Env) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        p, pid = _start_sleeper(env)
        p.send_signal(sig)
        assert p.wait(10) == -sig  # the client dies of the same signal
        _wait_gone(pid)
    # a signal the command handles: it decides (here: exits 5)
    p = subprocess.Popen(
        env.argv("sh", "-c", "trap 'exit 5' USR1; echo ready; while :; do sleep 0.05; done"),
        stdout=subprocess.PIPE,
        env=env.env(),
    )
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    p.send_signal(signal.SIGUSR1)
    assert p.wait(10) == 5


def test_signals_are_relayed_from_a_caller_that_blocked_them(env: Env) -> None:
    # The mask is inherited across exec: the client unblocks what it relays.
    p = subprocess.Popen(
        env.argv("sh", "-c", "echo $$; exec sleep 60"),
        stdout=subprocess.PIPE,
        env=env.env(),
        cwd=env.root,
        preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM]),
    )
    assert p.stdout is not None
    pid = int(p.stdout.readline())
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == -signal.SIGTERM
    _wait_gone(pid)


def test_client_killed_kills_command(env: Env) -> None:
    p, pid = _start_sleeper(env)
    p.kill()
    p.wait(10)
    _wait_gone(pid)


def test_suspend_and_resume(env: Env) -> None:
    p, pid = _start_sleeper(env)
    try:
        p.send_signal(signal.SIGTSTP)
        wait_until(lambda: _state(pid) == "T", 5, what="the command to stop")
        p.send_signal(signal.SIGCONT)
        wait_until(lambda: _state(pid) in ("S", "R"), 5, what="the command to continue")
    finally:
        p.terminate()
        p.wait(10)
    _wait_gone(pid)


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
