"""envd driven by the real E2B Python SDK (sync API).

A tiny fake control plane answers ``POST /v2/sandboxes``; ``E2B_SANDBOX_URL``
points the SDK's data plane straight at envd, whose token is set via /init.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import http_server_thread, wait_until

e2b = pytest.importorskip("e2b")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="envd tests run as root")

TOKEN = "tok"
SANDBOX = {
    "sandboxID": "sbx1",
    "templateID": "base",
    "clientID": "x",
    "envdVersion": "0.6.4",
    "envdAccessToken": TOKEN,
}


class _ControlPlane(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: Any = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)

    def do_POST(self) -> None:
        self._body()
        if self.path == "/v2/sandboxes":
            self._send(201, SANDBOX)
        elif self.path == "/v2/sandboxes/sbx1/connect":
            self._send(200, SANDBOX)
        elif self.path.startswith("/sandboxes/sbx1/"):
            self._send(204)
        else:
            self._send(404, {"code": 404, "message": "not found"})

    def do_DELETE(self) -> None:
        self._send(204 if self.path == "/sandboxes/sbx1" else 404)

    def do_GET(self) -> None:
        if self.path.startswith("/sandboxes/sbx1"):
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self._send(
                200,
                {
                    **SANDBOX,
                    "startedAt": now,
                    "endAt": now,
                    "cpuCount": 1,
                    "memoryMB": 512,
                    "diskSizeMB": 1024,
                    "state": "running",
                },
            )
        else:
            self._send(404, {"code": 404, "message": "not found"})


@pytest.fixture(scope="module")
def envd(envd_launcher: Callable[..., str]) -> str:
    url = envd_launcher()
    r = httpx.post(url + "/init", json={"accessToken": TOKEN, "envVars": {"SANDBOX_VAR": "sv"}})
    assert r.status_code == 204
    return url


@pytest.fixture(scope="module")
def sbx(envd: str) -> Iterator[Any]:
    mp = pytest.MonkeyPatch()
    with http_server_thread(_ControlPlane) as control_url:
        mp.setenv("E2B_API_URL", control_url)
        mp.setenv("E2B_SANDBOX_URL", envd)
        mp.setenv("E2B_API_KEY", "x")
        mp.delenv("E2B_DEBUG", raising=False)
        try:
            sandbox = e2b.Sandbox.create()
            yield sandbox
            assert sandbox.kill() is True
        finally:
            mp.undo()


def test_commands_run(sbx: Any, tmp_path: Path) -> None:
    r = sbx.commands.run("echo hello; echo oops >&2", user="root")
    assert r.stdout == "hello\n" and r.stderr == "oops\n" and r.exit_code == 0

    with pytest.raises(e2b.CommandExitException) as ei:
        sbx.commands.run("echo partial; exit 4", user="root")
    assert ei.value.exit_code == 4 and ei.value.stdout == "partial\n"

    r = sbx.commands.run(
        'echo "$SANDBOX_VAR $MY_VAR $(pwd)"', envs={"MY_VAR": "mv"}, cwd=str(tmp_path), user="root"
    )
    assert r.stdout == f"sv mv {tmp_path}\n"


def test_commands_with_env_no_process_could_have_are_refused(sbx: Any) -> None:
    for envs in ({"A=B": "x"}, {"A": "x\0y"}, {"BIG": "x" * (1 << 20)}):
        with pytest.raises(e2b.InvalidArgumentException):
            sbx.commands.run("echo ran", envs=envs, user="root")
    # The sandbox is unharmed: the next command runs.
    assert sbx.commands.run("echo $SANDBOX_VAR", user="root").stdout == "sv\n"


def test_on_stdout_order(sbx: Any) -> None:
    got: list[str] = []
    sbx.commands.run("for i in $(seq 1 200); do echo $i; done", on_stdout=got.append, user="root")
    assert "".join(got) == "".join(f"{i}\n" for i in range(1, 201))


def test_background_stdin_list_kill(sbx: Any, tmp_path: Path) -> None:
    echoed = tmp_path / "echoed"
    h = sbx.commands.run(f"tee {echoed}", background=True, stdin=True, user="root")
    sbx.commands.send_stdin(h.pid, "ping\n")
    pids = [p.pid for p in sbx.commands.list()]
    assert h.pid in pids
    # Once tee has the line its stdout has it too (waiting in envd until the handle reads).
    for _ in range(200):
        if echoed.exists() and echoed.read_text() == "ping\n":
            break
        time.sleep(0.05)
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(e2b.CommandExitException) as ei:
        h.wait()
    assert ei.value.exit_code == -1
    assert "ping\n" in ei.value.stdout
    assert sbx.commands.kill(h.pid) is False


def test_default_user_and_stream_input(sbx: Any) -> None:
    assert sbx.commands.run("whoami").stdout == "root\n"  # no `user` account here
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.stream_input(h.pid, ["str-", b"bytes", "\n"])
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout == "str-bytes\n"


async def test_async_watch_dir(sbx: Any, tmp_path: Path) -> None:
    asbx = await e2b.AsyncSandbox.create()
    events: list[Any] = []
    handle = await asbx.files.watch_dir(str(tmp_path), events.append, user="root")
    (tmp_path / "async.txt").write_text("1")
    for _ in range(100):
        if any(e.name == "async.txt" for e in events):
            break
        await asyncio.sleep(0.05)
    await handle.stop()
    assert ("async.txt", "CREATE") in {(e.name, e.type.name) for e in events}


def test_connect_to_running_command(sbx: Any) -> None:
    h = sbx.commands.run("sleep 0.5; echo late", background=True, user="root")
    h2 = sbx.commands.connect(h.pid)
    r = h2.wait()
    assert r.stdout == "late\n" and r.exit_code == 0


def test_files(sbx: Any, tmp_path: Path) -> None:
    p = str(tmp_path / "dir" / "a.txt")
    info = sbx.files.write(p, "text content", user="root")
    assert info.path == p and info.name == "a.txt"
    assert sbx.files.read(p, user="root") == "text content"
    blob = os.urandom(1024 * 1024)
    b = str(tmp_path / "blob.bin")
    sbx.files.write(b, blob, user="root")
    assert bytes(sbx.files.read(b, format="bytes", user="root")) == blob
    assert bytes(sbx.files.read(b, format="bytes", gzip=True, user="root")) == blob
    sbx.files.write(str(tmp_path / "gz.bin"), blob, gzip=True, user="root")
    assert (tmp_path / "gz.bin").read_bytes() == blob

    names = {e.name for e in sbx.files.list(str(tmp_path), user="root")}
    assert names == {"dir", "blob.bin", "gz.bin"}
    assert sbx.files.exists(p, user="root") is True
    assert sbx.files.exists(str(tmp_path / "nope"), user="root") is False
    moved = sbx.files.rename(p, str(tmp_path / "b.txt"), user="root")
    assert moved.path == str(tmp_path / "b.txt")
    assert sbx.files.make_dir(str(tmp_path / "x" / "y"), user="root") is True
    assert sbx.files.make_dir(str(tmp_path / "x" / "y"), user="root") is False
    info = sbx.files.get_info(str(tmp_path / "b.txt"), user="root")
    assert info.size == len("text content") and info.type == e2b.FileType.FILE
    assert info.permissions == "-rw-r--r--" and info.owner == "root"
    with pytest.raises(e2b.FileNotFoundException):
        sbx.files.get_info(str(tmp_path / "nope"), user="root")
    with pytest.raises(e2b.FileNotFoundException):
        sbx.files.read(str(tmp_path / "nope"), user="root")
    sbx.files.remove(str(tmp_path / "x"), user="root")
    assert not (tmp_path / "x").exists()

    written = sbx.files.write_files(
        [
            {"path": str(tmp_path / "m1.txt"), "data": "one"},
            {"path": str(tmp_path / "m2.txt"), "data": b"two"},
        ],
        user="root",
    )
    assert [w.name for w in written] == ["m1.txt", "m2.txt"]
    assert (tmp_path / "m2.txt").read_text() == "two"
    meta = sbx.files.write(str(tmp_path / "meta.txt"), "m", metadata={"Kind": "note"}, user="root")
    assert meta.metadata == {"kind": "note"}
    assert sbx.files.get_info(str(tmp_path / "meta.txt"), user="root").metadata == {"kind": "note"}


def test_watch_dir(sbx: Any, tmp_path: Path) -> None:
    handle = sbx.files.watch_dir(str(tmp_path), user="root", recursive=True)
    (tmp_path / "new.txt").write_text("data")
    kinds: set[tuple[str, str]] = set()

    def written() -> bool:
        kinds.update((e.name, e.type.name) for e in handle.get_new_events())
        return ("new.txt", "WRITE") in kinds

    try:
        wait_until(written, 10, 0.02, "the watch to report the write")
    finally:
        handle.stop()
    assert ("new.txt", "CREATE") in kinds and ("new.txt", "WRITE") in kinds


def test_pty(sbx: Any) -> None:
    out = bytearray()
    h = sbx.pty.create(e2b.PtySize(rows=24, cols=80), user="root", timeout=30)
    sbx.pty.send_stdin(h.pid, b"echo pty-$((6*7))\n")
    thread_out: list[bytes] = []

    def consume() -> None:
        with contextlib.suppress(Exception):
            h.wait(on_pty=lambda data: thread_out.append(bytes(data)))

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    wait_until(lambda: b"pty-42" in b"".join(thread_out), what="the pty's echo")
    sbx.pty.resize(h.pid, e2b.PtySize(rows=30, cols=100))
    assert sbx.pty.kill(h.pid) is True
    t.join(5)
    out += b"".join(thread_out)
    assert b"pty-42" in out


def test_unknown_user_and_bad_token(sbx: Any, envd: str) -> None:
    with pytest.raises(e2b.AuthenticationException):
        sbx.commands.run("true", user="no-such-user")
    other = e2b.Sandbox(
        sandbox_id="sbx1",
        envd_version="0.6.4",
        envd_access_token="wrong",
        sandbox_domain=None,
        connection_config=e2b.ConnectionConfig(sandbox_url=envd, api_key="x"),
    )
    with pytest.raises(e2b.AuthenticationException):
        other.commands.run("true", user="root")
    with pytest.raises(e2b.AuthenticationException):
        other.files.read("/etc/hostname", user="root")


def test_signed_url(sbx: Any, tmp_path: Path) -> None:
    f = tmp_path / "dl.txt"
    f.write_text("download me")
    url = sbx.download_url(str(f), user="root")
    r = httpx.get(url)
    assert r.status_code == 200 and r.text == "download me"
    url = sbx.download_url(str(f), user="root", use_signature_expiration=60)
    assert httpx.get(url).text == "download me"
    tampered = url.replace("dl.txt", "other.txt")
    assert httpx.get(tampered).status_code == 401
    up = sbx.upload_url(str(tmp_path / "ul.txt"), user="root")
    r = httpx.post(up, files={"file": ("ul.txt", b"uploaded")})
    assert r.status_code == 200 and (tmp_path / "ul.txt").read_bytes() == b"uploaded"
