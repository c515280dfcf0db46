"""The `aenv` CLI against a real server: exec, ls, rm, start (PTY), snapshot, fork."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import subprocess
import time

import pytest

from .conftest import AENV, Server

pytestmark = pytest.mark.integration


def aenv(
    server: Server, *args: str, check: bool = True, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, AENV_URL=server.url, AENV_API_KEY=server.api_key)
    proc = subprocess.run(
        [AENV, *args], env=env, capture_output=True, text=True, timeout=120, input=input
    )
    if check:
        assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    return proc


def test_start_exec_ls_rm(server: Server) -> None:
    sid = aenv(server, "start", "--detach", "-m", "via=cli").stdout.strip()
    try:
        out = aenv(
            server,
            "exec",
            sid,
            "--",
            "sh",
            "-c",
            "echo to-out; echo to-err >&2; exit 4",
            check=False,
        )
        assert out.returncode == 4
        assert out.stdout == "to-out\n" and out.stderr == "to-err\n"
        assert sid in aenv(server, "ls").stdout
        listed = aenv(server, "ls", "-m", "via=cli", "-o", "json").stdout
        assert sid in listed
    finally:
        aenv(server, "rm", sid)
    gone = aenv(server, "rm", sid, check=False)
    assert (
        gone.returncode == 1
        and gone.stderr.startswith("aenv: ")
        and len(gone.stderr.splitlines()) == 1
    )


def test_interactive_start_through_a_pty(server: Server) -> None:
    env = dict(os.environ, AENV_URL=server.url, AENV_API_KEY=server.api_key, TERM="xterm")
    pid, fd = pty.fork()
    if pid == 0:  # child: the CLI on a real terminal
        os.execve(AENV, [AENV, "start", "base"], env)
    out = b""

    def read_until(marker: bytes, timeout: float = 60) -> None:
        nonlocal out
        deadline = time.time() + timeout
        while marker not in out:
            assert time.time() < deadline, out[-2000:]
            r, _, _ = select.select([fd], [], [], 0.5)
            if r:
                try:
                    out += os.read(fd, 65536)
                except OSError:
                    break

    read_until(b"$ ")
    os.write(fd, b"echo answer-$((6*7)); whoami\r")
    read_until(b"answer-42")
    os.write(fd, b"exit\r")
    deadline = time.time() + 60
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        r, _, _ = select.select([fd], [], [], 0.5)
        if r:
            with contextlib.suppress(OSError):
                out += os.read(fd, 65536)
    else:
        os.kill(pid, 9)
        pytest.fail("aenv start did not exit")
    assert os.waitstatus_to_exitcode(status) == 0
    assert b"user" in out


def test_snapshot_and_fork_commands(server: Server) -> None:
    sid = aenv(server, "start", "--detach").stdout.strip()
    kids: list[str] = []
    try:
        aenv(server, "exec", sid, "--", "sh", "-c", "echo parent > ~/who")
        snap = aenv(server, "snapshot", "create", sid, "--name", f"cli-{sid}").stdout.strip()
        assert snap in aenv(server, "snapshot", "ls", "--sandbox-id", sid).stdout
        # Its lifecycle setting: set, shown, refused when not seconds, back to the node's.
        set_out = aenv(server, "template", "set", snap, "--standby-after", "7.5").stdout
        assert set_out == f"{snap}\tstandby-after=7.5\n"
        bad = aenv(server, "template", "set", snap, "--standby-after", "soon", check=False)
        assert bad.returncode == 1 and len(bad.stderr.splitlines()) == 1
        reset = aenv(server, "template", "set", snap, "--standby-after", "node").stdout
        assert reset == f"{snap}\tstandby-after=node\n"
        kids = aenv(server, "fork", sid, "--count", "2").stdout.split()
        assert len(kids) == 2
        for k in kids:
            assert aenv(server, "exec", k, "--", "cat", "/home/user/who").stdout == "parent\n"
        aenv(server, "pause", sid)
        aenv(server, "resume", sid)
        assert aenv(server, "exec", sid, "--", "echo", "back").stdout == "back\n"
        aenv(server, "template", "rm", snap)
    finally:
        aenv(server, "rm", sid, *kids, check=False)


def test_tree_fork_from_a_snapshot_and_rm_all(server: Server) -> None:
    """Lineage through a fork and a snapshot, N sandboxes from a named snapshot, and a bulk
    kill by metadata that takes exactly the matching ones."""
    tag = f"lin{time.time_ns()}"
    sid = aenv(server, "start", "--detach", "-m", f"sweep={tag}").stdout.strip()
    kids: list[str] = []
    made: list[str] = []
    try:
        kids = aenv(server, "fork", sid).stdout.split()  # a fork child keeps the metadata
        snap = aenv(server, "snapshot", "create", kids[0], "--name", f"lin-{sid}").stdout.strip()
        made = aenv(server, "fork", f"lin-{sid}", "--count", "2").stdout.split()
        assert len(made) == 2
        tree = json.loads(aenv(server, "tree", made[0], "-o", "json").stdout)
        assert [a["sandboxID"] for a in tree["ancestors"]] == [sid, kids[0]]
        assert tree["lineage"]["snapshotID"] == snap
        drawn = aenv(server, "tree", sid).stdout
        assert all(i in drawn for i in (sid, *kids, *made))
        killed = aenv(server, "rm", "--all", "-m", f"sweep={tag}").stdout.split()
        assert sorted(killed) == sorted([sid, *kids])
        tree = json.loads(aenv(server, "tree", made[1], "-o", "json").stdout)
        assert tree["ancestors"] == [{"sandboxID": kids[0], "state": "killed"}]
    finally:
        aenv(server, "rm", sid, *kids, *made, check=False)
        aenv(server, "template", "rm", f"lin-{sid}", check=False)
