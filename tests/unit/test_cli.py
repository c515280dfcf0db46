"""The `aenv` CLI against a fake control plane + fake envd on loopback.

The fake answers the few control-plane routes the CLI uses (E2B REST shapes) and streams
Connect envelopes for `process.Process/Start`, routed by `E2b-Sandbox-Id` like the real
server's single port. Real end-to-end tests against real sandboxes live elsewhere.
"""

from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
from typer.testing import CliRunner

from aenv.cli.connect import ConnectError, run_with
from aenv.cli.errors import CliError
from aenv.cli.main import app
from aenv.cli.session import exit_code_of, run_command, signal_number
from aenv.envd_client import EnvdClient, EnvdTarget
from aenv.envd_wire import EnvelopeDecoder, b64decode, encode_envelope, parse_process_event
from tests.helpers import free_port, http_server_thread, wait_until

API_KEY = "e2b_test_key"


def _iso(dt: datetime) -> str:
    return dt.isoformat().replace("+00:00", "Z")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class FakeAenv:
    """State of the fake server; tests read `requests` to check what the CLI sent."""

    def __init__(self) -> None:
        self.url = ""
        self.sandboxes: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.inputs: dict[int, queue.Queue[bytes | None]] = {}
        self.updates: list[dict[str, Any]] = []
        self.signals: list[dict[str, Any]] = []
        self.snapshots: list[dict[str, Any]] = []
        self.page_size = 2
        self.next_pid = 100
        self.gate = threading.Event()
        self.gate_ok: bool | None = None
        self.lock = threading.Lock()

    def add(self, sandbox_id: str, **fields: Any) -> dict[str, Any]:
        now = datetime.now(UTC)
        sb = {
            "sandboxID": sandbox_id,
            "templateID": "base",
            "alias": "base",
            "clientID": "local",
            "startedAt": _iso(now - timedelta(seconds=30)),
            "endAt": _iso(now + timedelta(seconds=270)),
            "envdVersion": "0.6.4",
            "cpuCount": 2,
            "memoryMB": 512,
            "diskSizeMB": 1024,
            "state": "running",
            "metadata": {},
            "envdAccessToken": f"tok-{sandbox_id}",
        }
        sb.update(fields)
        self.sandboxes[sandbox_id] = sb
        return sb

    def new_pid(self) -> int:
        with self.lock:
            self.next_pid += 1
            pid = self.next_pid
        self.inputs[pid] = queue.Queue()
        return pid


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # close-delimited streams; one request per connection
    fake: FakeAenv

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    # -- plumbing -----------------------------------------------------------------------

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, body: Any = None, ctype: str = "application/json") -> None:
        raw = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if raw:
            self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"code": status, "message": message})

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def _route(self, method: str) -> None:
        body = self._body()
        url = urlsplit(self.path)
        self.fake.requests.append((method, self.path, dict(self.headers.items()), body))
        if self.headers.get("E2b-Sandbox-Id"):
            self._envd(url.path, body)
        else:
            self._control(method, url.path, parse_qs(url.query), body)

    # -- control plane ------------------------------------------------------------------

    def _control(self, method: str, path: str, query: dict[str, list[str]], body: bytes) -> None:
        fake = self.fake
        if self.headers.get("X-API-KEY") != API_KEY:
            return self._error(401, "Invalid API key")
        parts = [unquote(p) for p in path.strip("/").split("/")]
        data = json.loads(body) if body else {}
        if method == "POST" and parts == ["v2", "sandboxes"]:
            sb = fake.add(f"sbx{len(fake.sandboxes) + 1:03d}", templateID=data["templateID"])
            sb["metadata"] = data.get("metadata", {})
            return self._send(
                201,
                {
                    k: sb[k]
                    for k in (
                        "sandboxID",
                        "templateID",
                        "clientID",
                        "envdVersion",
                        "envdAccessToken",
                    )
                },
            )
        if method == "GET" and parts == ["v2", "sandboxes"]:
            items = list(fake.sandboxes.values())
            if "state" in query:
                wanted = query["state"][0].split(",")
                items = [s for s in items if s["state"] in wanted]
            if "metadata" in query:
                want = {k: v[0] for k, v in parse_qs(query["metadata"][0]).items()}
                items = [
                    s for s in items if all(s["metadata"].get(k) == v for k, v in want.items())
                ]
            start = int(query.get("nextToken", ["0"])[0])
            page = items[start : start + fake.page_size]
            listed = [{k: v for k, v in s.items() if k != "envdAccessToken"} for s in page]
            raw = json.dumps(listed).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            if start + fake.page_size < len(items):
                self.send_header("x-next-token", str(start + fake.page_size))
            self.end_headers()
            self.wfile.write(raw)
            return None
        if method == "GET" and parts == ["snapshots"]:
            return self._send(200, fake.snapshots)
        if len(parts) >= 2 and parts[0] in ("sandboxes", "v2"):
            sid = parts[1] if parts[0] == "sandboxes" else parts[2]
            found = fake.sandboxes.get(sid)
            if found is None:
                return self._error(404, f"sandbox {sid} not found")
            sb = found
            if method == "GET" and parts == ["sandboxes", sid]:
                return self._send(200, sb)
            if method == "DELETE" and parts == ["sandboxes", sid]:
                del fake.sandboxes[sid]
                return self._send(204)
            if method == "POST" and parts == ["sandboxes", sid, "pause"]:
                if sb["state"] == "paused":
                    return self._error(409, f"sandbox {sid} is already paused")
                sb["state"] = "paused"
                return self._send(204)
            if method == "POST" and parts == ["v2", "sandboxes", sid, "connect"]:
                resumed = sb["state"] == "paused"
                sb["state"] = "running"
                return self._send(201 if resumed else 200, sb)
            if method == "POST" and parts == ["sandboxes", sid, "timeout"]:
                return self._send(204)
            if method == "POST" and parts == ["sandboxes", sid, "snapshots"]:
                snap = {
                    "snapshotID": f"snap{len(fake.snapshots) + 1}",
                    "names": [data["name"]] if "name" in data else [],
                    "mode": "filesystem" if data.get("memory") is False else "full",
                }
                fake.snapshots.append(snap)
                return self._send(201, snap)
        return self._error(404, f"no route {method} {path}")

    # -- envd ---------------------------------------------------------------------------

    def _envd(self, path: str, body: bytes) -> None:
        fake = self.fake
        sid = self.headers["E2b-Sandbox-Id"]
        sb = fake.sandboxes.get(sid)
        if sb is None:
            return self._error(404, f"sandbox {sid} not found")
        if self.headers.get("E2b-Sandbox-Port") != "49983":
            return self._error(502, "bad port")
        if self.headers.get("X-Access-Token") != sb["envdAccessToken"]:
            return self._send(401, {"code": "unauthenticated", "message": "bad access token"})
        if path == "/process.Process/Start":
            assert self.headers["Content-Type"] == "application/connect+json"
            msgs = EnvelopeDecoder().feed(body)
            assert len(msgs) == 1 and msgs[0][0] == 0
            return self._start(json.loads(msgs[0][1]))
        req = json.loads(body)
        assert self.headers["Content-Type"] == "application/json"
        pid = int(req["process"]["pid"])
        if pid not in fake.inputs:
            return self._send(404, {"code": "not_found", "message": f"process {pid} not found"})
        if path == "/process.Process/SendInput":
            data = req["input"].get("stdin") or req["input"].get("pty")
            fake.inputs[pid].put(b64decode(data))
        elif path == "/process.Process/CloseStdin":
            fake.inputs[pid].put(None)
        elif path == "/process.Process/Update":
            fake.updates.append(req)
        elif path == "/process.Process/SendSignal":
            fake.signals.append(req)
            fake.inputs[pid].put(None)
        else:
            return self._send(501, {"code": "unimplemented", "message": path})
        return self._send(200, {})

    def _emit(self, event: dict[str, Any]) -> None:
        self.wfile.write(encode_envelope({"event": event}))
        self.wfile.flush()

    def _start(self, req: dict[str, Any]) -> None:
        fake = self.fake
        self.send_response(200)
        self.send_header("Content-Type", "application/connect+json")
        self.end_headers()
        pid = fake.new_pid()
        self._emit({"start": {"pid": pid}})
        self._emit({"keepalive": {}})
        proc = req["process"]
        if "pty" in req:
            # A toy shell: echoes typed input back as PTY output, exits at ^D.
            self._emit({"data": {"pty": _b64(b"$ ")}})
            while True:
                chunk = fake.inputs[pid].get(timeout=10)
                if chunk is None:
                    break
                done = b"\x04" in chunk
                chunk = chunk.replace(b"\x04", b"")
                if chunk:
                    self._emit({"data": {"pty": _b64(chunk.replace(b"\n", b"\r\n"))}})
                if done:
                    break
            self._emit({"end": {"exited": True, "status": "exit status 0"}})
        else:
            cmd = proc["args"][2]
            if cmd == "streamy":
                self._emit({"data": {"stdout": _b64(b"out1\n")}})
                fake.gate_ok = fake.gate.wait(5)
                self._emit({"data": {"stderr": _b64(b"err1\n")}})
                self._emit({"data": {"stdout": _b64(b"out2\n")}})
                self._emit({"end": {"exitCode": 3, "exited": True, "status": "exit status 3"}})
            elif cmd == "killed":
                self._emit({"end": {"exitCode": -1, "status": "signal: killed"}})
            elif cmd == "cat":
                while (chunk := fake.inputs[pid].get(timeout=10)) is not None:
                    self._emit({"data": {"stdout": _b64(chunk)}})
                self._emit({"end": {"exited": True, "status": "exit status 0"}})
            elif cmd == "slow":
                time.sleep(float(self.headers["Connect-Timeout-Ms"]) / 1000)
                err = {"code": "deadline_exceeded", "message": "context deadline exceeded"}
                self.wfile.write(encode_envelope({"error": err}, 2))
                return
            elif cmd == "broken":
                self.wfile.write(
                    encode_envelope({"error": {"code": "internal", "message": "exec failed"}}, 2)
                )
                return
            else:
                out = json.dumps({"cmd": cmd, "envs": proc.get("envs", {}), "cwd": proc.get("cwd")})
                self._emit({"data": {"stdout": _b64(out.encode() + b"\n")}})
                self._emit({"end": {"exited": True, "status": "exit status 0"}})
        self.wfile.write(encode_envelope({}, 2))
        self.wfile.flush()


@pytest.fixture
def fake() -> Iterator[FakeAenv]:
    state = FakeAenv()
    handler = type("Handler", (_Handler,), {"fake": state})
    with http_server_thread(handler) as url:
        state.url = url
        yield state


@pytest.fixture
def cli(fake: FakeAenv, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> CliRunner:
    monkeypatch.setenv("AENV_URL", fake.url)
    monkeypatch.setenv("AENV_API_KEY", API_KEY)
    monkeypatch.setenv("AENV_HOME", str(tmp_path))
    monkeypatch.delenv("AENV_CONFIG_FILE", raising=False)
    return CliRunner()


def _one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("aenv: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


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
    for args in (["ls"], ["rm", "x"], ["exec", "x", "--", "true"], ["start", "-d"]):
        res = cli.invoke(app, ["--url", f"http://127.0.0.1:{port}", *args])
        assert res.exit_code == 1, args
        line = _one_error_line(res.stderr)
        assert line.startswith(f"aenv: cannot reach the aenv server at http://127.0.0.1:{port}")


def test_bad_api_key_names_the_fix(cli: CliRunner) -> None:
    res = cli.invoke(app, ["--api-key", "wrong", "ls"])
    assert res.exit_code == 1
    line = _one_error_line(res.stderr)
    assert "Invalid API key" in line and "AENV_API_KEY" in line


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
    assert res.exit_code == 1
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


def test_exec_errors(cli: CliRunner, fake: FakeAenv) -> None:
    res = cli.invoke(app, ["exec", "nope", "--", "true"])
    assert res.exit_code == 1 and _one_error_line(res.stderr) == "aenv: sandbox nope not found"
    fake.add("sbx-p", state="paused")
    res = cli.invoke(app, ["exec", "sbx-p", "--", "true"])
    assert res.exit_code == 1 and "aenv resume sbx-p" in _one_error_line(res.stderr)
    fake.add("sbx-a")
    res = cli.invoke(app, ["exec", "sbx-a", "--", "broken"])
    assert res.exit_code == 1 and "exec failed" in _one_error_line(res.stderr)


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
