"""envd's spawn library (envd/spawn.c through envd/vspawn.py), compiled as the bundle
compiles it and used as root: the command runs as the user asked for, in a session of its
own, with only the descriptors given and default signal dispositions; failures come back as
the exceptions subprocess raises."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from aenv.envd.vspawn import Credentials, Spawner
from aenv.runtime.bundle_build import SPAWN_LIB, SPAWN_SOURCE, build_spawn_lib

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("cc") is None, reason="needs root and a C compiler"
)

SOURCE = Path(__file__).resolve().parents[2] / "src" / "aenv" / "envd" / SPAWN_SOURCE
ENV = {"PATH": "/usr/bin:/bin"}


@pytest.fixture(scope="module")
def spawner(tmp_path_factory: pytest.TempPathFactory) -> Spawner:
    out = tmp_path_factory.mktemp("spawn") / SPAWN_LIB
    build_spawn_lib(SOURCE, out)
    assert out.is_file()
    return Spawner(out)


def run(
    spawner: Spawner,
    argv: list[str],
    *,
    cwd: str,
    env: dict[str, str] = ENV,
    creds: Credentials | None = None,
) -> tuple[int, str]:
    """(exit status, stdout + stderr) of a command started by the spawner."""
    r, w = os.pipe2(os.O_CLOEXEC)
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        pid = spawner.spawn(argv, env, cwd=cwd, stdin=null, stdout=w, stderr=w, creds=creds)
    finally:
        os.close(w)
        os.close(null)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.decode()


def test_the_command_runs_as_the_user_with_its_groups_and_cwd(spawner: Spawner) -> None:
    code, out = run(
        spawner,
        ["sh", "-c", "id -u; id -g; id -G; pwd"],
        cwd="/tmp",
        creds=Credentials(65534, 65534, (65534, 100)),
    )
    assert code == 0
    assert out.split() == ["65534", "65534", "65534", "100", "/tmp"]


def _signal_masks() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("SigIgn", "SigBlk"):
            out[key] = int(value.strip(), 16)
    return out


def test_only_the_given_descriptors_a_new_session_and_default_signals(spawner: Spawner) -> None:
    # Held open (close-on-exec off) while spawning: it must not reach the command.
    leak = os.open(os.devnull, os.O_RDONLY)
    try:
        code, out = run(
            spawner,
            [
                "sh",
                "-c",
                # The masks first and by builtins: dash blocks every signal around each
                # command it starts and clears the mask only once that child has exec'd, so
                # a child reading the shell's status races it (seen under CI load).
                'while read -r k v; do case $k in SigBlk:|SigIgn:) echo "$k $v";; esac; '
                "done </proc/self/status; echo --; "
                # A simple command, no pipeline: while a pipeline's first part runs, the
                # shell itself may still hold the pipe of the next (a race under load).
                "ls /proc/$$/fd; echo --; "
                "ps -o sid= -p $$; echo $$",
            ],
            cwd="/",
        )
    finally:
        os.close(leak)
    assert code == 0
    masks, fds, rest = out.split("--\n")
    blocked, ignored = masks.splitlines()
    sid, pid = rest.splitlines()
    assert sorted(fds.split(), key=int) == ["0", "1", "2"]
    assert sid.strip() == pid  # a session leader
    # Python ignores SIGPIPE and SIGXFSZ: the command gets them at their default; what was
    # ignored or blocked before Python (inherited by this test) stays so, as with subprocess.
    mine = _signal_masks()
    python_ignores = (1 << (signal.SIGPIPE - 1)) | (1 << (signal.SIGXFSZ - 1))
    assert int(ignored.split()[1], 16) == mine["SigIgn"] & ~python_ignores
    assert int(blocked.split()[1], 16) == mine["SigBlk"]


def test_a_terminal_becomes_the_controlling_one(spawner: Spawner) -> None:
    master, slave = os.openpty()
    try:
        pid = spawner.spawn(
            ["sh", "-c", "tty; ps -o tty= -p $$"],
            ENV,
            cwd="/",
            stdin=slave,
            stdout=slave,
            stderr=slave,
            ctty=True,
            creds=Credentials(65534, 65534),
        )
        os.close(slave)
        slave = -1
        out = b""
        deadline = time.monotonic() + 10
        while b"\n" not in out.split(b"/dev/pts/", 1)[-1] and time.monotonic() < deadline:
            out += os.read(master, 4096)
        out += os.read(master, 4096)
        os.waitpid(pid, 0)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    lines = out.decode().split()
    assert lines[0].startswith("/dev/pts/")
    assert lines[1] == lines[0].removeprefix("/dev/")


def test_failures_are_the_exceptions_subprocess_raises(spawner: Spawner) -> None:
    with pytest.raises(FileNotFoundError) as missing:
        run(spawner, ["no-such-program-here"], cwd="/")
    assert missing.value.filename == "no-such-program-here"
    with pytest.raises(PermissionError):
        run(spawner, ["/etc/passwd"], cwd="/")
    with pytest.raises(FileNotFoundError) as no_dir:
        run(spawner, ["true"], cwd="/no/such/dir")
    assert no_dir.value.filename == "/no/such/dir"
    with pytest.raises(ValueError, match="null byte"):
        run(spawner, ["echo", "a\0b"], cwd="/")


def test_the_program_is_looked_up_on_the_commands_path(spawner: Spawner, tmp_path: Path) -> None:
    tool = tmp_path / "only-here"
    tool.write_text("#!/bin/sh\necho found me\n")
    tool.chmod(0o755)
    code, out = run(spawner, ["only-here"], cwd="/", env={"PATH": f"/nonexistent:{tmp_path}"})
    assert (code, out) == (0, "found me\n")


def test_a_program_other_than_argv0_and_a_umask(spawner: Spawner) -> None:
    """As sudo starts a command: the program by path, argv[0] as the caller named it, and
    the umask it asked for."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = spawner.spawn(
            ["named-by-caller", "-c", 'echo "$0"; umask'],
            ENV,
            executable="/bin/sh",
            cwd="/",
            stdin=-1,
            stdout=w,
            stderr=w,
            umask=0o027,
        )
    finally:
        os.close(w)
    out = b""
    while chunk := os.read(r, 4096):
        out += chunk
    os.close(r)
    os.waitpid(pid, 0)
    assert out.decode().split() == ["named-by-caller", "0027"]
