"""envd's privileged exec service and the sudo client, end to end on the host (envd runs as
root): root and exit codes, stdio, who may sudo and as whom, the environment a command gets,
the CLI's errors, and signals relayed to the command (suspend, resume, the client killed).

envd runs from a copy of its sources (as the bundle's ``aenv_envd``) with the service socket
and fake /etc/passwd and /etc/group in a world-readable temp dir; the client runs through the
real ``/usr/bin/sudo`` wrapper script, pointed at a fake bundle of symlinks to the host's
python3.11, as root and, under ``setpriv``, as uids that exist only in the fake passwd
(tests/unit/sudo_env.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator

import pytest

from aenv.envd import sudo_protocol
from tests.helpers import wait_until
from tests.unit.sudo_env import ALICE, BOB, LOADER, SUDO_GID, SYSTEM_PY, Env, sudo_env

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
