"""The `aenv` CLI against a real server: auth and status, cp of directory trees both ways,
exec with piped stdin, ls/inspect/logs/top output, snapshot rm, template tags, and errors
as one line with a non-zero exit code."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import wait_until

from .conftest import AENV, Server

pytestmark = pytest.mark.integration


def run(
    args: list[str], env: dict[str, str], *, input: str | bytes | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [AENV, *args],
        env=env,
        capture_output=True,
        timeout=300,
        input=input.encode() if isinstance(input, str) else input,
        stdin=None if input is not None else subprocess.DEVNULL,
    )
    out = subprocess.CompletedProcess(
        proc.args,
        proc.returncode,
        proc.stdout.decode(errors="replace"),
        proc.stderr.decode(errors="replace"),
    )
    if check:
        assert out.returncode == 0, (args, out.stdout[-2000:], out.stderr[-2000:])
    return out


def cli_env(server: Server) -> dict[str, str]:
    return dict(os.environ, AENV_URL=server.url, AENV_API_KEY=server.api_key)


def one_line_error(res: subprocess.CompletedProcess[str]) -> None:
    assert res.returncode != 0, res
    assert res.stderr.startswith("aenv: ") and res.stderr.count("\n") == 1, res.stderr
    assert "Traceback" not in res.stderr


@pytest.fixture
def sandbox(server: Server) -> Iterator[str]:
    sid = run(["start", "-d", "-m", "via=cli-tools"], cli_env(server)).stdout.strip()
    try:
        yield sid
    finally:
        with server.client() as c:
            c.delete(f"/sandboxes/{sid}")


# -- auth and status --------------------------------------------------------------------------


def test_auth_status_and_precedence(server: Server, tmp_path: Path) -> None:
    # No AENV_* or E2B_* at all, an empty node home: only what `aenv auth` stores can work.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    env.update(
        XDG_CONFIG_HOME=str(tmp_path / "xdg"),
        HOME=str(tmp_path / "home"),
        AENV_HOME=str(tmp_path / "node-home"),
        AENV_LISTEN="127.0.0.1:9",  # no server there
    )
    creds = tmp_path / "xdg" / "aenv" / "credentials"

    res = run(["ls"], env, check=False)
    one_line_error(res)

    # A refused key and an unreachable server: one line each, nothing stored.
    res = run(["auth", "--url", server.url, "--api-key", "e2b_wrong"], env, check=False)
    one_line_error(res)
    assert "refused the API key" in res.stderr and not creds.exists()
    res = run(["auth", "--url", "http://127.0.0.1:9", "--api-key", "k"], env, check=False)
    one_line_error(res)
    assert "cannot reach" in res.stderr and not creds.exists()

    # The prompts, answered from a pipe.
    res = run(["auth"], env, input=f"{server.url}\n{server.api_key}\n")
    assert server.url in res.stdout and server.api_key not in res.stdout + res.stderr
    assert stat.S_IMODE(creds.stat().st_mode) == 0o600
    assert stat.S_IMODE(creds.parent.stat().st_mode) == 0o700
    assert server.api_key in creds.read_text()

    # The stored credentials are used without any option or environment.
    assert isinstance(json.loads(run(["ls"], env).stdout), list)
    status = run(["status"], env).stdout
    assert server.url in status and "from context 'default'" in status
    assert "authenticated   yes" in status and "node " in status
    info = json.loads(run(["status", "-o", "json"], env).stdout)
    assert info["reachable"] and info["authenticated"] and info["serverVersion"]
    assert isinstance(info["sandboxes"], dict) and info["nodes"][0]["cpuCount"] >= 1
    assert info["nodes"][0]["runtime"] == {"backend": "gvisor", "accelerator": "systrap"}
    assert re.search(r"backend +gvisor \(systrap\)", status)

    # The environment overrides the file: a bad key there fails, even with good stored ones.
    res = run(["ls"], dict(env, AENV_API_KEY="e2b_wrong"), check=False)
    one_line_error(res)
    assert "AENV_API_KEY" in res.stderr
    # Another URL never gets the stored key.
    res = run(["status"], dict(env, AENV_URL="http://127.0.0.1:9"), check=False)
    assert res.returncode == 1 and "reachable       no" in res.stdout
    assert res.stderr.startswith("aenv: cannot reach") and res.stderr.count("\n") == 1

    # Non-interactive auth with options replaces the file; logout removes it.
    run(["auth", "--url", server.url + "/", "--api-key", server.api_key], env)
    assert f'url = "{server.url}"' in creds.read_text()
    run(["auth", "--logout"], env)
    assert not creds.exists()
    one_line_error(run(["ls"], env, check=False))


# -- cp ---------------------------------------------------------------------------------------


def _make_tree(root: Path) -> None:
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "empty-dir").mkdir()
    (root / "empty-file").write_bytes(b"")
    (root / "a" / "binary.bin").write_bytes(bytes(range(256)) * 64 + b"\x00\xff" * 100)
    (root / "a" / "b" / "c" / "deep.txt").write_text("deep\n")
    (root / "a" / "b" / "big.dat").write_bytes(os.urandom(5 * 1024 * 1024 + 123))
    (root / "name with spaces.txt").write_text("spaces\n")
    script = root / "run.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o755)
    (root / "private").write_text("secret\n")
    (root / "private").chmod(0o600)


def _digest(root: Path) -> dict[str, str]:
    """Relative path -> content hash and mode, directories included."""
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        mode = stat.S_IMODE(p.stat().st_mode)
        if p.is_dir():
            out[rel + "/"] = f"dir {mode:o}"
        else:
            out[rel] = f"{hashlib.sha256(p.read_bytes()).hexdigest()} {mode:o}"
    return out


def test_cp_directory_tree_both_ways(server: Server, sandbox: str, tmp_path: Path) -> None:
    env = cli_env(server)
    src = tmp_path / "tree"
    _make_tree(src)
    want = _digest(src)

    # Into an existing directory: under its own name.
    res = run(["cp", str(src), f"{sandbox}:/home/user/"], env)
    assert f"{sandbox}:/home/user/tree" in res.stderr
    remote = run(
        ["exec", sandbox, "--", "cd /home/user/tree && find . | sort && sha256sum a/b/big.dat"],
        env,
    ).stdout
    assert "./empty-dir" in remote and "./a/b/c/deep.txt" in remote
    big_hash = hashlib.sha256((src / "a/b/big.dat").read_bytes()).hexdigest()
    assert big_hash in remote
    assert run(["exec", sandbox, "--", "/home/user/tree/run.sh"], env).stdout == "ran\n"

    # Back out, to a new local path: the copy is that path; identical contents and modes.
    back = tmp_path / "back"
    run(["cp", f"{sandbox}:/home/user/tree", str(back)], env)
    assert _digest(back) == want
    # Again into an existing local directory: under the source's name.
    (tmp_path / "into").mkdir()
    run(["cp", f"{sandbox}:tree", str(tmp_path / "into")], env)  # relative: the home
    assert _digest(tmp_path / "into" / "tree") == want

    # One file each way, and through stdin/stdout.
    run(["cp", str(src / "a" / "binary.bin"), f"{sandbox}:/tmp/renamed.bin"], env)
    out = subprocess.run(
        [AENV, "cp", f"{sandbox}:/tmp/renamed.bin", "-"], env=env, capture_output=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout == (src / "a" / "binary.bin").read_bytes()
    run(["cp", "-", f"{sandbox}:/tmp/from-stdin.txt"], env, input="piped in\n")
    run(["cp", f"{sandbox}:/tmp/from-stdin.txt", str(tmp_path)], env)
    assert (tmp_path / "from-stdin.txt").read_text() == "piped in\n"

    # Errors: one line each.
    one_line_error(run(["cp", f"{sandbox}:/nope", str(tmp_path / "x")], env, check=False))
    one_line_error(run(["cp", str(tmp_path / "nope"), f"{sandbox}:/tmp/"], env, check=False))
    one_line_error(run(["cp", str(src), f"{sandbox}:/tmp/from-stdin.txt"], env, check=False))
    one_line_error(run(["cp", str(src), "no-such-sandbox:/tmp/"], env, check=False))


def test_cp_refuses_a_paused_sandbox(server: Server, sandbox: str, tmp_path: Path) -> None:
    env = cli_env(server)
    (tmp_path / "f").write_text("x")
    run(["pause", sandbox], env)
    res = run(["cp", str(tmp_path / "f"), f"{sandbox}:/tmp/"], env, check=False)
    one_line_error(res)
    assert "paused" in res.stderr and f"aenv resume {sandbox}" in res.stderr


# -- exec, ls, inspect, logs, top ---------------------------------------------------------------


def test_exec_stdin_ls_inspect(server: Server, sandbox: str) -> None:
    env = cli_env(server)
    # Piped stdin is forwarded without -i; -I turns it off.
    assert run(["exec", sandbox, "--", "cat"], env, input="hello\nworld\n").stdout == (
        "hello\nworld\n"
    )
    data = os.urandom(200_000)
    raw = subprocess.run(
        [AENV, "exec", sandbox, "--", "wc -c"], env=env, input=data, capture_output=True
    )
    assert raw.returncode == 0 and raw.stdout.strip() == b"200000"
    assert run(["exec", "-I", sandbox, "--", "cat"], env, input="ignored").stdout == ""
    res = run(["exec", sandbox, "--", "sh", "-c", "echo e >&2; exit 5"], env, check=False)
    assert res.returncode == 5 and res.stderr == "e\n"

    # ls: JSON when piped (as here), a table when asked.
    listed = json.loads(run(["ls"], env).stdout)
    assert sandbox in [s["sandboxID"] for s in listed]
    assert sandbox in run(["ls", "-o", "table", "-m", "via=cli-tools"], env).stdout
    assert json.loads(run(["ls", "-s", "paused", "-m", "via=cli-tools"], env).stdout) == []

    info = json.loads(run(["inspect", sandbox, "-o", "json"], env).stdout)
    assert info["sandboxID"] == sandbox and info["state"] == "running"
    table = run(["inspect", sandbox], env).stdout
    assert "running" in table and "via=cli-tools" in table
    assert sandbox in run(["info", sandbox], env).stdout  # the old name still works
    one_line_error(run(["inspect", "no-such-sandbox"], env, check=False))


def test_exec_keeps_the_sandbox_alive(server: Server) -> None:
    env = cli_env(server)
    sid = run(["start", "-d", "--timeout", "8"], env).stdout.strip()
    try:
        # Longer than the sandbox's own timeout: exec's keepalive pushes its end forward.
        res = run(["exec", sid, "--", "sleep 12; echo survived"], env)
        assert res.stdout == "survived\n"
    finally:
        with server.client() as c:
            c.delete(f"/sandboxes/{sid}")


def test_logs_and_follow(server: Server, sandbox: str) -> None:
    env = cli_env(server)
    run(["exec", sandbox, "--", "true"], env)
    lines = run(["logs", sandbox], env).stdout.splitlines()
    assert lines and all(len(line.split()) >= 3 for line in lines)
    entries = [
        json.loads(x) for x in run(["logs", sandbox, "-o", "json"], env).stdout.split("\n") if x
    ]
    assert len(entries) == len(lines) and all("message" in e for e in entries)
    assert len(run(["logs", sandbox, "-n", "1"], env).stdout.splitlines()) == 1

    follow = subprocess.Popen(
        [AENV, "logs", sandbox, "-f", "--interval", "0.5", "-o", "json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert follow.stdout is not None and follow.stderr is not None
    printed: list[str] = []

    def read() -> None:
        assert follow.stdout is not None
        for line in follow.stdout:
            printed.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        marker = f"marker-{uuid.uuid4().hex[:8]}"
        run(["exec", sandbox, "--", f"echo {marker} >/dev/null"], env)
        wait_until(
            lambda: any(marker in line for line in printed),
            60,
            0.1,
            "the follower to print the new process's entries",
        )
        run(["rm", sandbox], env)
        assert follow.wait(timeout=60) == 0, follow.stderr.read()
        reader.join(30)
        err = follow.stderr.read()
        seen = [json.loads(x) for x in printed if x.strip()]
        assert len(seen) > len(entries)  # the new process's entries arrived while following
        assert any(marker in json.dumps(e) for e in seen), seen[-5:]
        assert len({json.dumps(e, sort_keys=True) for e in seen}) == len(seen)  # no repeats
        assert "is gone" in err
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()


def test_top_once(server: Server, sandbox: str) -> None:
    env = cli_env(server)
    run(["exec", sandbox, "--", "true"], env)
    frame = run(["top", "--once"], env).stdout
    assert "running" in frame and "CPU%" in frame and sandbox in frame
    rows = json.loads(run(["top", "-o", "json"], env).stdout)
    mine = [r for r in rows if r["sandboxID"] == sandbox]
    assert len(mine) == 1 and "metrics" in mine[0]
    deadline = time.monotonic() + 60
    while mine[0]["metrics"] is None and time.monotonic() < deadline:  # the node's first sample
        time.sleep(2)
        rows = json.loads(run(["top", "-o", "json", "-m", "via=cli-tools"], env).stdout)
        mine = [r for r in rows if r["sandboxID"] == sandbox]
    assert mine[0]["metrics"] and mine[0]["metrics"]["memTotal"] > 0
    assert sandbox in run(["top", "--once", "--sort", "mem"], env).stdout
    one_line_error(run(["top", "--once", "--sort", "nope"], env, check=False))


# -- snapshots and tags ---------------------------------------------------------------------------


def test_snapshot_rm_and_template_tags(server: Server, sandbox: str) -> None:
    env = cli_env(server)
    name = f"cli-snap-{uuid.uuid4().hex[:8]}"
    snap = run(["snapshot", "create", sandbox, "--name", name], env).stdout.strip()
    try:
        tags = json.loads(run(["template", "tags", "ls", name], env).stdout)
        assert [t["tag"] for t in tags] == ["default"]
        res = run(["template", "tags", "add", name, "v1", "stable"], env)
        assert "v1" in res.stdout and "stable" in res.stdout
        table = run(["template", "tags", "ls", name, "-o", "table"], env).stdout
        assert all(t in table for t in ("default", "v1", "stable", "BUILD"))
        run(["template", "tags", "rm", name, "stable"], env)
        tags = json.loads(run(["template", "tags", "ls", name], env).stdout)
        assert sorted(t["tag"] for t in tags) == ["default", "v1"]
        # A sandbox from the tag.
        child = run(["start", "-d", f"{name}:v1"], env).stdout.strip()
        run(["rm", child], env)
        one_line_error(run(["template", "tags", "add", name, "bad tag!"], env, check=False))

        assert run(["snapshot", "rm", snap], env).stdout.split() == [snap]
        snaps = json.loads(run(["snapshot", "ls", "--json"], env).stdout)
        assert snap not in [s["snapshotID"] for s in snaps]
        res = run(["snapshot", "rm", snap], env, check=False)
        one_line_error(res)
    finally:
        with contextlib.suppress(Exception), server.client() as c:
            c.delete(f"/templates/{snap}")
