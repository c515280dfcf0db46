"""The `aenv` CLI against a fake control plane + fake envd on loopback (tests/unit/fake_aenv.py):
exit codes, the control-plane commands (ls, rm, start, pause, resume, snapshots, templates)
and their one-line errors, a shell on a tty, and the in-process commands (template build-base,
server). `aenv exec` is in test_cli_exec.py. Real end-to-end tests against real sandboxes live
elsewhere.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from typing import Any

import pytest
from typer.testing import CliRunner

from aenv.cli.main import app
from aenv.cli.session import exit_code_of, signal_number
from aenv.envd_wire import EnvelopeDecoder, parse_process_event
from tests.helpers import free_port, wait_until
from tests.unit.fake_aenv import API_KEY, FakeAenv, _one_error_line

# -- exit codes (the wire format itself: test_envd_wire.py) -----------------------------


@pytest.mark.parametrize(
    ("end", "code"),
    [
        ({"exitCode": 3, "exited": True, "status": "exit status 3"}, 3),
        ({"exited": True}, 0),
        ({}, 0),
        ({"exitCode": -1, "status": "signal: killed"}, 137),
        ({"exitCode": -1, "status": "signal: terminated"}, 143),
        ({"exitCode": -1, "status": "signal: SIGINT"}, 130),
        ({"exitCode": -9}, 137),
        ({"exitCode": -1}, 1),
        ({"error": "exec format error"}, 1),
    ],
)
def test_exit_code_of(end: dict[str, Any], code: int) -> None:
    event = parse_process_event({"event": {"end": end}})
    assert event is not None and event.kind == "end"
    assert exit_code_of(event) == code


def test_signal_number() -> None:
    assert signal_number("signal: killed") == 9
    assert signal_number("signal: 15") == 15
    assert signal_number("exit status 1") is None


# -- control plane ----------------------------------------------------------------------


def test_ls_table_and_json(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a", metadata={"team": "alpha"})
    fake.add("sbx-b", state="paused", cpuCount=4, memoryMB=2048)
    fake.add("sbx-c", metadata={"team": "beta"})

    # Not a terminal: JSON unless a table is asked for.
    res = cli.invoke(app, ["ls"])
    assert res.exit_code == 0, res.output
    assert sorted(s["sandboxID"] for s in json.loads(res.stdout)) == ["sbx-a", "sbx-b", "sbx-c"]

    res = cli.invoke(app, ["ls", "-o", "table"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].split() == [
        "ID",
        "TEMPLATE",
        "STATE",
        "STARTED",
        "ENDS",
        "CPU",
        "MEMORY",
        "METADATA",
    ]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {"sbx-a", "sbx-b", "sbx-c"}  # three pages of 2 were followed
    assert "paused" in rows["sbx-b"] and "2048 MB" in rows["sbx-b"]
    assert "team=alpha" in rows["sbx-a"] and "in 4m" in rows["sbx-a"]

    res = cli.invoke(app, ["ls", "--output", "json", "--state", "running", "-m", "team=beta"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [s["sandboxID"] for s in data] == ["sbx-c"]
    listed = [r for r in fake.requests if r[1].startswith("/v2/sandboxes?")][-1]
    assert "state=running" in listed[1] and "metadata=team%3Dbeta" in listed[1]


def test_ls_rejects_bad_state(cli: CliRunner) -> None:
    res = cli.invoke(app, ["ls", "--state", "running,dead"])
    assert res.exit_code == 1
    assert "--state" in _one_error_line(res.stderr)


def test_rm_unknown_id_is_one_line_and_exit_1(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a")
    fake.add("sbx-b")
    res = cli.invoke(app, ["rm", "sbx-a", "nope", "sbx-b"])
    assert res.exit_code == 1
    assert res.stdout.split() == ["sbx-a", "sbx-b"]  # tried all
    assert _one_error_line(res.stderr) == "aenv: sandbox nope not found"
    assert fake.sandboxes == {}


def test_server_unreachable_is_one_line(cli: CliRunner) -> None:
    port = free_port()
    for args, code in (
        (["ls"], 1),
        (["rm", "x"], 1),
        (["exec", "x", "--", "true"], 125),  # a command's code passes through exec: docker's
        (["start", "-d"], 125),
    ):
        res = cli.invoke(app, ["--url", f"http://127.0.0.1:{port}", *args])
        assert res.exit_code == code, args
        line = _one_error_line(res.stderr)
        assert line.startswith(f"aenv: cannot reach the aenv server at http://127.0.0.1:{port}")


def test_bad_api_key_names_the_fix(cli: CliRunner) -> None:
    res = cli.invoke(app, ["--api-key", "wrong", "ls"])
    assert res.exit_code == 1
    line = _one_error_line(res.stderr)
    assert "Invalid API key" in line and "check --api-key" in line
    # The hint names where the refused key came from.
    res = cli.invoke(app, ["ls"], env={"AENV_API_KEY": "wrong"})
    assert "check AENV_API_KEY" in _one_error_line(res.stderr)


def test_api_key_read_from_aenv_home(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.delenv("AENV_API_KEY")
    res = cli.invoke(app, ["ls"])
    assert res.exit_code == 1 and "does not exist" in _one_error_line(res.stderr)
    assert not (tmp_path / "secrets" / "api-key").exists()  # the CLI never creates a key
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "api-key").write_text(API_KEY + "\n")
    res = cli.invoke(app, ["ls"])
    assert res.exit_code == 0, res.output


def test_start_detach_prints_id(cli: CliRunner, fake: FakeAenv) -> None:
    res = cli.invoke(
        app,
        [
            "start",
            "tmpl",
            "-d",
            "--timeout",
            "60",
            "--cpu",
            "4",
            "--memory",
            "1024",
            "--metadata",
            "k=v",
            "--env",
            "A=1",
        ],
    )
    assert res.exit_code == 0, res.output
    sid = res.stdout.strip()
    assert sid in fake.sandboxes
    method, path, headers, body = next(r for r in fake.requests if r[1] == "/v2/sandboxes")
    assert method == "POST" and headers["X-API-KEY"] == API_KEY
    assert json.loads(body) == {
        "templateID": "tmpl",
        "timeout": 60,
        "metadata": {"k": "v"},
        "envVars": {"A": "1"},
        "cpuCount": 4,
        "memoryMB": 1024,
    }


def test_start_bad_pair_is_usage_error(cli: CliRunner, fake: FakeAenv) -> None:
    res = cli.invoke(app, ["start", "-d", "--env", "NOEQUALS"])
    assert res.exit_code == 125  # start passes a shell's code through: its own are 125
    assert "KEY=VALUE" in _one_error_line(res.stderr)
    assert fake.sandboxes == {}


def test_start_shell_with_piped_stdin_then_removes(cli: CliRunner, fake: FakeAenv) -> None:
    res = cli.invoke(app, ["start", "--env", "X=1"], input="echo hi\n")
    assert res.exit_code == 0, res.output
    assert b"$ echo hi\r\n" in res.stdout_bytes  # raw PTY bytes, untouched
    start = next(r for r in fake.requests if r[1] == "/process.Process/Start")
    req = json.loads(EnvelopeDecoder().feed(start[3])[0][1])
    assert req["process"]["cmd"] == "/bin/bash" and req["process"]["args"] == ["-i", "-l"]
    assert req["process"]["envs"]["TERM"]
    assert req["pty"]["size"]["cols"] > 0 and req["pty"]["size"]["rows"] > 0
    assert start[2]["X-Access-Token"] == "tok-sbx001" and start[2]["E2b-Sandbox-Port"] == "49983"
    assert fake.sandboxes == {}  # killed after the shell exited
    assert any(r[0] == "DELETE" for r in fake.requests)


def _read_until(fd: int, needle: bytes, timeout: float = 10.0) -> bytes:
    buf = b""
    deadline = time.monotonic() + timeout
    while needle not in buf and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
    return buf


def test_start_on_a_tty_raw_mode_resize_and_restore(fake: FakeAenv, tmp_path: Any) -> None:
    """`aenv start` on a real PTY: raw mode while attached, SIGWINCH → Update, terminal
    restored afterwards."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    before = termios.tcgetattr(slave)
    env = {
        **os.environ,
        "AENV_URL": fake.url,
        "AENV_API_KEY": API_KEY,
        "AENV_HOME": str(tmp_path),
        "TERM": "xterm-test",
    }
    child = subprocess.Popen(
        [sys.executable, "-m", "aenv.cli.main", "start"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    try:
        out = _read_until(master, b"$ ")
        assert b"$ " in out, out
        assert not termios.tcgetattr(slave)[3] & termios.ECHO  # raw: no local echo
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        child.send_signal(signal.SIGWINCH)
        wait_until(lambda: fake.updates, what="the pty resize to reach the server")
        assert fake.updates[-1]["pty"]["size"] == {"cols": 120, "rows": 40}
        os.write(master, b"echo hi\r")
        assert b"echo hi" in _read_until(master, b"echo hi")
        os.write(master, b"\x04")
        assert child.wait(10) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        after = termios.tcgetattr(slave)
        os.close(master)
        os.close(slave)
    assert after == before
    start = next(r for r in fake.requests if r[1] == "/process.Process/Start")
    req = json.loads(EnvelopeDecoder().feed(start[3])[0][1])
    assert req["pty"]["size"] == {"cols": 100, "rows": 30}
    assert req["process"]["envs"]["TERM"] == "xterm-test"
    assert fake.sandboxes == {}


def test_start_keep_prints_reconnect(cli: CliRunner, fake: FakeAenv) -> None:
    res = cli.invoke(app, ["start", "--keep"], input="")
    assert res.exit_code == 0, res.output
    assert list(fake.sandboxes) == ["sbx001"]
    assert "aenv connect sbx001" in res.stderr


def test_pause_resume_timeout_info(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a", metadata={"x": "[bold]y[/]"})
    assert cli.invoke(app, ["pause", "sbx-a"]).stdout.strip() == "sbx-a"
    assert fake.sandboxes["sbx-a"]["state"] == "paused"
    res = cli.invoke(app, ["pause", "sbx-a"])
    assert res.exit_code == 1 and "already paused" in _one_error_line(res.stderr)
    res = cli.invoke(app, ["resume", "sbx-a", "--timeout", "120"])
    assert res.exit_code == 0 and fake.sandboxes["sbx-a"]["state"] == "running"
    assert json.loads(fake.requests[-1][3]) == {"timeout": 120}
    res = cli.invoke(app, ["timeout", "sbx-a", "30"])
    assert res.exit_code == 0 and json.loads(fake.requests[-1][3]) == {"timeout": 30}
    res = cli.invoke(app, ["info", "sbx-a"])
    assert res.exit_code == 0
    assert "x=[bold]y[/]" in res.stdout  # server data is not rich markup
    assert "tok-sbx-a" not in res.stdout
    res = cli.invoke(app, ["info", "sbx-a", "-o", "json"])
    assert json.loads(res.stdout)["sandboxID"] == "sbx-a"


def test_snapshot_create_modes_and_ls(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-s")
    res = cli.invoke(app, ["snapshot", "create", "sbx-s", "--name", "full-one"])
    assert res.exit_code == 0 and res.stdout.strip() == "snap1"
    assert json.loads(fake.requests[-1][3]) == {"name": "full-one"}
    res = cli.invoke(app, ["snapshot", "create", "sbx-s", "--filesystem"])
    assert res.exit_code == 0 and res.stdout.strip() == "snap2"
    assert json.loads(fake.requests[-1][3]) == {"memory": False}
    res = cli.invoke(app, ["snapshot", "ls"])
    rows = {line.split()[0]: line.split()[1] for line in res.stdout.splitlines()[1:] if line}
    assert rows == {"snap1": "full", "snap2": "filesystem"}, res.stdout


def test_template_ls_404_is_a_message(cli: CliRunner) -> None:
    res = cli.invoke(app, ["template", "ls"])
    assert res.exit_code == 1
    assert "does not list templates" in _one_error_line(res.stderr)


# -- in-process commands ----------------------------------------------------------------


def test_template_build_base_progress_quiet_and_errors(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aenv.builds import base
    from aenv.errors import AenvError

    seen: list[Any] = []

    def fake_build(settings: Any, *, force: bool = False, progress: Any = None) -> list[str]:
        seen.append((force, progress is not None))
        if progress:
            progress("cache", "machine cache /var/cache/aenv")
            progress("debootstrap", "I: Retrieving [InRelease]")
            progress("debootstrap", "I: Validating")
            progress("done", "template base = sha256:abc")
        return ["sha256:abc"]

    monkeypatch.setattr(base, "build_base", fake_build)
    res = cli.invoke(app, ["template", "build-base", "--force"])
    assert res.exit_code == 0, res.output
    assert res.stdout == "template base: sha256:abc\n"
    assert "debootstrap: I: Retrieving [InRelease]" in res.stderr  # not eaten as markup
    assert "✓ cache" in res.stderr and "✓ debootstrap" in res.stderr
    res = cli.invoke(app, ["template", "build-base", "--quiet"])
    assert res.exit_code == 0 and res.stdout == "" and res.stderr == ""
    assert seen == [(True, True), (False, False)]

    def failing(settings: Any, **kw: Any) -> list[str]:
        raise AenvError("debootstrap failed (exit 1):\nE: no network")

    monkeypatch.setattr(base, "build_base", failing)
    res = cli.invoke(app, ["template", "build-base", "-q"])
    assert res.exit_code == 1
    assert _one_error_line(res.stderr) == "aenv: debootstrap failed (exit 1): | E: no network"


def test_server_command_passes_settings(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    import aenv.server

    got: list[Any] = []
    monkeypatch.setattr(aenv.server, "serve", got.append)
    res = cli.invoke(app, ["server", "--listen", "127.0.0.1:9999"])
    assert res.exit_code == 0, res.output
    assert got[0].listen == "127.0.0.1:9999" and got[0].home == tmp_path
