"""`aenv exec` and the command runner against a fake control plane + fake envd on loopback
(tests/unit/fake_aenv.py): streamed output and exit codes, command, env, cwd and user, signals,
timeouts, stdin, keeping the sandbox alive, and envd's errors as connect errors.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from typer.testing import CliRunner

from aenv.cli.connect import ConnectError, run_with
from aenv.cli.errors import CliError
from aenv.cli.main import app
from aenv.cli.session import run_command
from aenv.envd_client import EnvdClient, EnvdTarget
from aenv.envd_wire import EnvelopeDecoder
from tests.helpers import free_port
from tests.unit.fake_aenv import FakeAenv, _b64, _one_error_line

# -- exec -------------------------------------------------------------------------------


def test_exec_streams_and_returns_exit_code(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a")
    fake.gate.set()
    res = cli.invoke(app, ["exec", "sbx-a", "--", "streamy"])
    assert res.exit_code == 3
    assert res.stdout == "out1\nout2\n"
    assert res.stderr == "err1\n"
    start = next(r for r in fake.requests if r[1] == "/process.Process/Start")
    assert start[2]["E2b-Sandbox-Id"] == "sbx-a"
    assert start[2]["X-Access-Token"] == "tok-sbx-a"
    assert "X-API-KEY" not in start[2]  # the API key never goes to envd


def test_exec_command_env_cwd_user(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a")
    res = cli.invoke(
        app,
        [
            "exec",
            "sbx-a",
            "--user",
            "root",
            "--cwd",
            "/tmp",
            "-e",
            "A=b c",
            "--",
            "ls",
            "-la",
            "my dir",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out == {"cmd": "ls -la 'my dir'", "envs": {"A": "b c"}, "cwd": "/tmp"}
    start = next(r for r in fake.requests if r[1] == "/process.Process/Start")
    assert start[2]["Authorization"] == "Basic " + _b64(b"root:")
    res = cli.invoke(app, ["exec", "sbx-a", "echo $HOME | wc -c"])
    assert json.loads(res.stdout)["cmd"] == "echo $HOME | wc -c"


def test_exec_signal_exit_code(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a")
    assert cli.invoke(app, ["exec", "sbx-a", "--", "killed"]).exit_code == 137


def test_exec_timeout_exits_124(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a")
    res = cli.invoke(app, ["exec", "sbx-a", "--timeout", "1", "--", "slow"])
    assert res.exit_code == 124
    assert _one_error_line(res.stderr) == "aenv: command timed out after 1s"
    start = next(r for r in fake.requests if r[1] == "/process.Process/Start")
    assert start[2]["Connect-Timeout-Ms"] == "1000"


def test_exec_stdin(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a")
    res = cli.invoke(app, ["exec", "sbx-a", "--stdin", "--", "cat"], input="line1\nline2\n")
    assert res.exit_code == 0, res.output
    assert res.stdout == "line1\nline2\n"


def _start_body(fake: FakeAenv) -> dict[str, Any]:
    start = [r for r in fake.requests if r[1] == "/process.Process/Start"][-1]
    return dict(json.loads(EnvelopeDecoder().feed(start[3])[0][1]))


def test_exec_forwards_piped_stdin_by_default(cli: CliRunner, fake: FakeAenv) -> None:
    """CliRunner's stdin is not a terminal: it is forwarded without --stdin; -I keeps it
    back and says so to envd (which would otherwise keep the command's stdin open)."""
    fake.add("sbx-a")
    res = cli.invoke(app, ["exec", "sbx-a", "--", "cat"], input="piped\n")
    assert res.exit_code == 0, res.output
    assert res.stdout == "piped\n"
    assert _start_body(fake)["stdin"] is True
    res = cli.invoke(app, ["exec", "-I", "sbx-a", "--", "true"], input="held back")
    assert res.exit_code == 0, res.output
    assert _start_body(fake)["stdin"] is False


def test_exec_keeps_its_sandbox_alive(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a")
    res = cli.invoke(app, ["exec", "sbx-a", "-I", "--", "true"])
    assert res.exit_code == 0, res.output
    connects = [r for r in fake.requests if r[1] == "/v2/sandboxes/sbx-a/connect"]
    assert connects and json.loads(connects[0][3]) == {"timeout": 300}


def test_exec_errors_of_aenv_itself_exit_125(cli: CliRunner, fake: FakeAenv) -> None:
    """docker's convention: 125 is aenv's own failure, never a code the command gave."""
    res = cli.invoke(app, ["exec", "nope", "--", "true"])
    assert res.exit_code == 125 and _one_error_line(res.stderr) == "aenv: sandbox nope not found"
    fake.add("sbx-p", state="paused")
    res = cli.invoke(app, ["exec", "sbx-p", "--", "true"])
    assert res.exit_code == 125 and "aenv resume sbx-p" in _one_error_line(res.stderr)
    fake.add("sbx-a")
    res = cli.invoke(app, ["exec", "sbx-a", "--", "broken"])
    assert res.exit_code == 125 and "exec failed" in _one_error_line(res.stderr)
    # Usage mistakes too (a command's 2 would be ambiguous).
    for args in (["exec"], ["exec", "sbx-a", "--bogus", "--", "true"], ["exec", "sbx-a"]):
        res = cli.invoke(app, args)
        assert res.exit_code == 125, args
        assert _one_error_line(res.stderr).startswith("aenv: ")
    # Outside the commands that pass a code through, a failure stays 1.
    assert cli.invoke(app, ["inspect", "nope"]).exit_code == 1


@pytest.mark.parametrize(
    ("command", "code", "says"),
    [
        ("no-shell", 127, "command not found"),
        ("no-permission", 126, "cannot be invoked"),
        ("bad-cwd", 126, "cannot be invoked"),
    ],
)
def test_exec_command_that_cannot_start(
    cli: CliRunner, fake: FakeAenv, command: str, code: int, says: str
) -> None:
    fake.add("sbx-a")
    for tty in ([], ["-t"]):
        res = cli.invoke(app, ["exec", *tty, "sbx-a", "--", command])
        assert res.exit_code == code, (tty, res.output)
        assert says in _one_error_line(res.stderr)


@pytest.mark.parametrize("code", [0, 1, 2, 42, 125, 126, 127])
def test_exec_passes_the_commands_exit_code_through(
    cli: CliRunner, fake: FakeAenv, code: int
) -> None:
    """Whatever the command exits with is aenv's exit code, bash's own 126/127 included."""
    fake.add("sbx-a")
    res = cli.invoke(app, ["exec", "sbx-a", f"exit {code}"])
    assert res.exit_code == code and res.stderr == ""


def test_exec_tty_runs_the_command_on_a_pty(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a")
    res = cli.invoke(app, ["exec", "-t", "sbx-a", "tty-hello"])
    assert res.exit_code == 5, res.output
    assert res.stdout.strip() == "hello"
    body = _start_body(fake)
    assert body["process"]["args"] == ["-l", "-c", "tty-hello"] and "pty" in body
    assert not any(r[1] == "/process.Process/SendInput" for r in fake.requests)  # no -i


def test_exec_it_is_interactive_on_a_pty(cli: CliRunner, fake: FakeAenv) -> None:
    """`-it` as docker: stdin typed into the PTY (the fake echoes it, exits at ^D)."""
    fake.add("sbx-a")
    res = cli.invoke(app, ["exec", "-it", "sbx-a", "bash"], input="echo hi\n")
    assert res.exit_code == 0, res.output
    assert "echo hi" in res.stdout
    body = _start_body(fake)
    assert body["process"]["args"] == ["-l", "-c", "bash"] and "pty" in body
    res = cli.invoke(app, ["exec", "sbx-a", "-ti", "--", "bash"], input="again\n")
    assert res.exit_code == 0 and "again" in res.stdout


def test_exec_old_dash_t_seconds_is_still_a_timeout(cli: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a")
    for args in (["exec", "sbx-a", "-t", "1", "--", "slow"], ["exec", "-t", "1", "sbx-a", "slow"]):
        res = cli.invoke(app, args)
        assert res.exit_code == 124, args
        assert "now `--timeout 1`" in res.stderr and "timed out after 1s" in res.stderr


def test_run_command_writes_output_before_the_stream_ends(fake: FakeAenv) -> None:
    """The fake holds the stream after `out1` until the client has written it."""
    fake.add("sbx-a")

    class Sink(io.BytesIO):
        def write(self, data: Any) -> int:
            n = super().write(data)
            if b"out1" in self.getvalue():
                fake.gate.set()
            return n

    out, err = Sink(), io.BytesIO()
    code = run_with(
        _envd(fake, "tok-sbx-a"), lambda envd: run_command(envd, "streamy", stdout=out, stderr=err)
    )
    # The gate opened on out1: the output was streamed before the command ended.
    assert code == 3 and fake.gate_ok is True
    assert out.getvalue() == b"out1\nout2\n" and err.getvalue() == b"err1\n"


def _envd(fake: FakeAenv, token: str) -> EnvdClient:
    return EnvdClient(EnvdTarget.routed(fake.url, "sbx-a", token))


def test_envd_errors_are_connect_errors(fake: FakeAenv) -> None:
    fake.add("sbx-a")

    async def stream(envd: EnvdClient) -> list[dict[str, Any]]:
        return [m async for m in envd.stream("process.Process/Start", {"process": {"cmd": "x"}})]

    with pytest.raises(ConnectError) as exc:
        run_with(_envd(fake, "wrong"), stream)
    assert exc.value.code == "unauthenticated" and exc.value.status == 401
    with pytest.raises(ConnectError) as exc:
        run_with(
            _envd(fake, "tok-sbx-a"),
            lambda envd: envd.unary(
                "process.Process/SendInput", {"process": {"pid": 1}, "input": {}}
            ),
        )
    assert exc.value.code == "not_found"
    assert isinstance(exc.value, CliError)


def test_an_unreachable_server_is_one_line_naming_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(CliError) as exc:
        run_with(
            EnvdClient(EnvdTarget.routed(url, "sbx-a", "t")),
            lambda envd: envd.unary("process.Process/SendInput", {}),
        )
    assert not isinstance(exc.value, ConnectError)
    assert exc.value.message.startswith(f"cannot reach the aenv server at {url}: ")
