"""A fake control plane + fake envd on loopback for the `aenv` CLI's unit tests.

The fake answers the few control-plane routes the CLI uses (E2B REST shapes) and streams
Connect envelopes for `process.Process/Start`, routed by `E2b-Sandbox-Id` like the real
server's single port; it records what it was asked.
"""

from __future__ import annotations

import base64
import json
import queue
import re
import threading
import time
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from aenv.envd_wire import EnvelopeDecoder, b64decode, encode_envelope

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
        # What `GET /sandboxes/{id}/lineage` answers, by id.
        self.lineages: dict[str, dict[str, Any]] = {}
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

    def _bulk(self, method: str, parts: list[str], query: dict[str, list[str]]) -> None:
        """`DELETE /sandboxes`, `POST /sandboxes/pause` and `/timeout` by metadata, as a
        node answers (the timeout changes nothing here)."""
        want = {k: v[0] for k, v in parse_qs(query.get("metadata", [""])[0]).items()}
        if not want:
            return self._error(400, "a non-empty metadata query is required")
        done, failed = [], []
        for sid, sb in list(self.fake.sandboxes.items()):
            if any(sb["metadata"].get(k) != v for k, v in want.items()):
                continue
            if method == "DELETE":
                del self.fake.sandboxes[sid]
            elif sb["state"] == "paused":
                continue
            elif sb["metadata"].get("stuck"):
                failed.append({"sandboxID": sid, "code": 503, "message": "would not pause"})
                continue
            elif parts[-1] == "pause":
                sb["state"] = "paused"
            done.append(sid)
        return self._send(200, {"sandboxIDs": done, "failed": failed})

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
        if (method, parts) in (
            ("DELETE", ["sandboxes"]),
            ("POST", ["sandboxes", "pause"]),
            ("POST", ["sandboxes", "timeout"]),
        ):
            return self._bulk(method, parts, query)
        if len(parts) >= 2 and parts[0] in ("sandboxes", "v2"):
            sid = parts[1] if parts[0] == "sandboxes" else parts[2]
            found = fake.sandboxes.get(sid)
            if found is None:
                return self._error(404, f"sandbox {sid} not found")
            sb = found
            if method == "GET" and parts == ["sandboxes", sid]:
                return self._send(200, sb)
            if method == "GET" and parts == ["sandboxes", sid, "lineage"]:
                return self._send(200, fake.lineages[sid])
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
        args = req["process"].get("args") or []
        refusal = _START_REFUSALS.get(args[-1] if args else "")
        if refusal is not None:  # envd could not start it: an error, no start event
            code, message = refusal
            self.wfile.write(encode_envelope({"error": {"code": code, "message": message}}, 2))
            return
        pid = fake.new_pid()
        self._emit({"start": {"pid": pid}})
        self._emit({"keepalive": {}})
        proc = req["process"]
        if "pty" in req and proc["args"] == ["-l", "-c", "tty-hello"]:
            self._emit({"data": {"pty": _b64(b"hello\r\n")}})
            self._emit({"end": {"exitCode": 5, "exited": True, "status": "exit status 5"}})
        elif "pty" in req:
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
            elif (m := re.fullmatch(r"exit (\d+)", cmd)) is not None:
                n = int(m.group(1))
                self._emit({"end": {"exitCode": n, "exited": True, "status": f"exit status {n}"}})
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


# Commands envd refuses to start, with its answers (aenv's envd words them so).
_START_REFUSALS = {
    "no-shell": (
        "invalid_argument",
        "failed to start process: [Errno 2] No such file or directory: '/bin/bash'",
    ),
    "no-permission": (
        "permission_denied",
        "failed to start process: [Errno 13] Permission denied: '/bin/bash'",
    ),
    "bad-cwd": ("invalid_argument", "cwd '/nope' does not exist"),
}


def _one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("aenv: "), stderr
    assert "Traceback" not in stderr
    return lines[0]
