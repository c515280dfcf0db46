"""The HTTP client the harness drives a server with: plain `httpx.AsyncClient`, the E2B
control-plane REST shapes and envd's Connect protocol (JSON codec), exactly what the E2B SDK
sends, without the SDK's own (sync, per-call) overhead. Every call returns its wall time
(`perf_counter`, ms) and the server's `Server-Timing` stages.

A feature the server does not have yet (404 "no route", 405, 501 on pause/snapshot/fork/...)
raises `Missing`, so a scenario can record the row as missing and go on.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from aenv.envd_wire import (
    PROCESS_START,
    StreamReader,
    WireError,
    auth_headers,
    call_headers,
    encode_envelope,
    parse_process_event,
    route_headers,
    start_request,
)

from .stats import parse_server_timing

# Per request while cleaning up: a server that does not answer is stopped and purged anyway.
CLEANUP_TIMEOUT = 30.0
TEMPLATE = "base"


class BenchError(Exception):
    """A step failed in a way that makes the current sample (or row) unusable."""


class Abort(BenchError):
    """A failure after which the row cannot go on (its sandbox is in an unknown state)."""


class Missing(BenchError):
    """The server does not implement this operation (404/405/501)."""

    def __init__(self, what: str, status: int, message: str) -> None:
        if status:
            text = f"{what}: not available on this server (HTTP {status}: {message})"
        else:
            text = f"{what}: {message}"
        super().__init__(text)
        self.what = what
        self.status = status


@dataclass
class Timed:
    ms: float
    stages: dict[str, float]
    data: Any = None
    status: int = 0


@dataclass
class Sbx:
    sandbox_id: str
    token: str | None


# Times a request refused with Retry-After is sent again.
RETRIES_AFTER = 20


def _describe(exc: httpx.HTTPError, seconds: float) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer after {seconds:.0f}s ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(body, dict):
        msg = body.get("message") or body.get("detail") or body.get("error")
        if msg:
            return str(msg)[:300]
    return str(body)[:200]


class Api:
    """One server: control plane plus envd through the server's proxy (one port)."""

    def __init__(
        self,
        url: str,
        api_key: str,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: float = 180.0,
        op_timeout: float | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.op_timeout = op_timeout
        self.metadata = dict(metadata or {})
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers={"X-API-Key": api_key, "User-Agent": "aenv-bench"},
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=400, max_keepalive_connections=200),
            transport=transport,
        )
        # Every sandbox and snapshot this client made and has not removed: cleanup by id.
        self.sandboxes: set[str] = set()
        self.snapshots: set[str] = set()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        what: str,
        ok: tuple[int, ...],
        json_body: Any = None,
        feature: bool = False,
        timeout: float | None = None,
    ) -> Timed:
        """One request; a `feature` call (pause, resume, snapshot, fork) waits at most
        `timeout` or the client's `op_timeout` seconds."""
        if timeout is None and feature:
            timeout = self.op_timeout
        t0 = time.perf_counter()
        for _ in range(RETRIES_AFTER):
            try:
                resp = await self._http.request(
                    method,
                    path,
                    json=json_body,
                    timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout,
                )
            except httpx.HTTPError as exc:
                raise BenchError(f"{what}: {_describe(exc, time.perf_counter() - t0)}") from None
            # A busy node says when to come back (503/429 + Retry-After): as a client should,
            # the bench does, and the wait counts in the operation's time.
            after = resp.headers.get("retry-after", "")
            if resp.status_code not in (429, 503) or not after.isdigit():
                break
            await asyncio.sleep(int(after))
        ms = (time.perf_counter() - t0) * 1000
        if resp.status_code not in ok:
            msg = _message(resp)
            if feature and (
                resp.status_code in (405, 501)
                or (resp.status_code == 404 and "no route" in msg.lower())
            ):
                raise Missing(what, resp.status_code, msg)
            raise BenchError(f"{what}: HTTP {resp.status_code}: {msg}")
        data: Any = None
        if resp.content:
            try:
                data = resp.json()
            except ValueError:
                data = None
        stages = parse_server_timing(resp.headers.get("server-timing"))
        return Timed(ms, stages, data, resp.status_code)

    # -- control plane ----------------------------------------------------------------------

    async def health(self) -> bool:
        try:
            resp = await self._http.get("/health", timeout=2.0)
        except httpx.HTTPError:
            return False
        return resp.status_code < 300

    async def create(
        self, *, memory_mb: int | None = None, timeout_s: int = 600, template: str = TEMPLATE
    ) -> tuple[Sbx, Timed]:
        body: dict[str, Any] = {
            "templateID": template,
            "timeout": timeout_s,
            "metadata": self.metadata,
            "envVars": {},
        }
        if memory_mb is not None:
            body["memoryMB"] = memory_mb
        t = await self._call("POST", "/v2/sandboxes", what="create", ok=(201, 200), json_body=body)
        if not isinstance(t.data, dict) or "sandboxID" not in t.data:
            raise BenchError(f"create: no sandboxID in the answer: {t.data!r:.200}")
        sbx = Sbx(str(t.data["sandboxID"]), t.data.get("envdAccessToken"))
        self.sandboxes.add(sbx.sandbox_id)
        return sbx, t

    async def kill(self, sandbox_id: str, timeout: float | None = None) -> None:
        """DELETE; a sandbox that is already gone is fine."""
        try:
            resp = await self._http.delete(
                f"/sandboxes/{quote(sandbox_id, safe='')}",
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.HTTPError as exc:
            raise BenchError(f"kill {sandbox_id}: {exc}") from None
        if resp.status_code not in (200, 204, 404):
            raise BenchError(f"kill {sandbox_id}: HTTP {resp.status_code}: {_message(resp)}")
        self.sandboxes.discard(sandbox_id)

    async def get(self, sandbox_id: str) -> dict[str, Any]:
        t = await self._call(
            "GET", f"/sandboxes/{quote(sandbox_id, safe='')}", what="get", ok=(200,)
        )
        return t.data if isinstance(t.data, dict) else {}

    async def list_ids(self) -> list[str]:
        """Ids of sandboxes (running and paused) carrying this client's metadata."""
        params: dict[str, str] = {}
        if self.metadata:
            params["metadata"] = "&".join(
                f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in self.metadata.items()
            )
        resp = await self._http.get("/v2/sandboxes", params=params, timeout=CLEANUP_TIMEOUT)
        if resp.status_code != 200:
            return []
        data = resp.json()
        return [str(s["sandboxID"]) for s in data if isinstance(s, dict) and "sandboxID" in s]

    async def has_route(self, method: str, path: str) -> tuple[bool, str]:
        """Whether the server routes `method path` at all (asked about a sandbox id that does
        not exist, so nothing happens): False on 405/501 or a 404 saying "no route"."""
        try:
            resp = await self._http.request(method, path, json={})
        except httpx.HTTPError as exc:
            raise BenchError(f"{method} {path}: {exc}") from None
        msg = _message(resp)
        if resp.status_code in (405, 501) or (
            resp.status_code == 404 and "no route" in msg.lower()
        ):
            return False, f"HTTP {resp.status_code}: {msg}"
        return True, ""

    async def pause(self, sandbox_id: str, *, memory: bool = True) -> Timed:
        """`memory=False`: E2B's `memory: false`, only the files are kept (the container is
        stopped, its memory released)."""
        return await self._call(
            "POST",
            f"/sandboxes/{quote(sandbox_id, safe='')}/pause",
            what="pause",
            ok=(204, 200),
            json_body={} if memory else {"memory": False},
            feature=True,
        )

    async def list_timed(self, limit: int = 1000) -> Timed:
        """`GET /v2/sandboxes?limit=N` (every state, no filter): the answer is the list."""
        t = await self._call(
            "GET", f"/v2/sandboxes?limit={limit}", what="list", ok=(200,), feature=True
        )
        if not isinstance(t.data, list):
            raise BenchError(f"list: the answer is not a list: {t.data!r:.200}")
        return t

    async def resume(self, sandbox_id: str) -> Timed:
        """`POST /v2/sandboxes/{id}/connect {}`; 201 = it was resumed."""
        return await self._call(
            "POST",
            f"/v2/sandboxes/{quote(sandbox_id, safe='')}/connect",
            what="resume",
            ok=(201, 200),
            json_body={},
            feature=True,
        )

    async def snapshot(self, sandbox_id: str, timeout: float | None = None) -> tuple[str, Timed]:
        t = await self._call(
            "POST",
            f"/sandboxes/{quote(sandbox_id, safe='')}/snapshots",
            what="snapshot",
            ok=(201, 200),
            json_body={},
            feature=True,
            timeout=timeout,
        )
        if not isinstance(t.data, dict) or not t.data.get("snapshotID"):
            raise BenchError(f"snapshot: no snapshotID in the answer: {t.data!r:.200}")
        sid = str(t.data["snapshotID"])
        self.snapshots.add(sid)
        return sid, t

    async def delete_snapshot(self, snapshot_id: str, timeout: float | None = None) -> None:
        try:
            resp = await self._http.delete(
                f"/templates/{quote(snapshot_id, safe='')}",
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.HTTPError as exc:
            raise BenchError(f"delete snapshot {snapshot_id}: {exc}") from None
        if resp.status_code not in (200, 204, 404):
            raise BenchError(
                f"delete snapshot {snapshot_id}: HTTP {resp.status_code}: {_message(resp)}"
            )
        self.snapshots.discard(snapshot_id)

    async def fork(self, sandbox_id: str, count: int) -> tuple[list[Sbx], list[str], Timed]:
        """Children that were made, the errors of those that were not, and the timing."""
        t = await self._call(
            "POST",
            f"/sandboxes/{quote(sandbox_id, safe='')}/fork",
            what="fork",
            ok=(201, 200),
            json_body={"count": count, "timeout": 600},
            feature=True,
        )
        if not isinstance(t.data, list):
            raise BenchError(f"fork: the answer is not a list: {t.data!r:.200}")
        children: list[Sbx] = []
        errors: list[str] = []
        for entry in t.data:
            sbx = entry.get("sandbox") if isinstance(entry, dict) else None
            if isinstance(sbx, dict) and sbx.get("sandboxID"):
                child = Sbx(str(sbx["sandboxID"]), sbx.get("envdAccessToken"))
                self.sandboxes.add(child.sandbox_id)
                children.append(child)
            else:
                err = entry.get("error") if isinstance(entry, dict) else entry
                errors.append(json.dumps(err)[:200])
        return children, errors, t

    async def diff(self, sandbox_id: str, timeout: float | None = None) -> Timed:
        """`GET /sandboxes/{id}/diff` against its fork point: the list of changes."""
        path = f"/sandboxes/{quote(sandbox_id, safe='')}/diff"
        return await self._call("GET", path, what="diff", ok=(200,), feature=True, timeout=timeout)

    async def apply(self, target: str, source: str, timeout: float | None = None) -> Timed:
        """`POST /sandboxes/{target}/apply {"from": source, "strategy": "theirs"}`."""
        return await self._call(
            "POST",
            f"/sandboxes/{quote(target, safe='')}/apply",
            what="apply",
            ok=(200,),
            json_body={"from": source, "strategy": "theirs"},
            feature=True,
            timeout=timeout,
        )

    async def rollback(self, sandbox_id: str, snapshot_id: str) -> Timed:
        """`POST /sandboxes/{id}/rollback {"snapshotID": ...}`: back to it, in place."""
        return await self._call(
            "POST",
            f"/sandboxes/{quote(sandbox_id, safe='')}/rollback",
            what="rollback",
            ok=(200,),
            json_body={"snapshotID": snapshot_id},
            feature=True,
        )

    # -- envd (through the server's proxy) ---------------------------------------------------

    def _files_headers(self, sbx: Sbx) -> dict[str, str]:
        return {
            **route_headers(sbx.sandbox_id),
            **auth_headers(sbx.token),
            "Content-Type": "application/octet-stream",
        }

    async def run(self, sbx: Sbx, cmd: str = "true", timeout: float = 60.0) -> Timed:
        """`commands.run(cmd)`: `process.Process/Start` with `/bin/bash -l -c cmd`, reading
        the server stream until the end-of-stream envelope; fails unless the exit code is 0
        (or no answer within `timeout` seconds of silence)."""
        headers = {
            **route_headers(sbx.sandbox_id),
            **auth_headers(sbx.token),
            **call_headers(stream=True),
        }
        body = encode_envelope(start_request("/bin/bash", ["-l", "-c", cmd]))
        reader = StreamReader()
        exit_code = 0
        t0 = time.perf_counter()
        try:
            async with self._http.stream(
                "POST",
                f"/{PROCESS_START}",
                content=body,
                headers=headers,
                timeout=httpx.Timeout(timeout, connect=10.0),
            ) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise BenchError(f"exec: HTTP {resp.status_code}: {_message(resp)}")
                async for chunk in resp.aiter_bytes():
                    for msg in reader.feed(chunk):
                        event = parse_process_event(msg)
                        if event is not None and event.kind == "end":
                            exit_code = event.exit_code
                    if reader.ended:
                        ms = (time.perf_counter() - t0) * 1000
                        if exit_code != 0:
                            raise BenchError(f"exec {cmd!r:.60}: exit code {exit_code}")
                        return Timed(ms, {}, None, 200)
        except WireError as exc:
            raise BenchError(f"exec: {exc} ({exc.code})") from None
        except httpx.HTTPError as exc:
            raise BenchError(f"exec: {_describe(exc, time.perf_counter() - t0)}") from None
        raise BenchError("exec: the stream ended without an end-of-stream message")

    async def write_file(self, sbx: Sbx, path: str, data: bytes) -> Timed:
        headers = self._files_headers(sbx)
        t0 = time.perf_counter()
        try:
            resp = await self._http.post(
                "/files", params={"path": path}, content=data, headers=headers
            )
        except httpx.HTTPError as exc:
            raise BenchError(f"write file: {exc}") from None
        ms = (time.perf_counter() - t0) * 1000
        if resp.status_code != 200:
            raise BenchError(f"write file: HTTP {resp.status_code}: {_message(resp)}")
        return Timed(ms, {}, None, 200)

    async def read_file(self, sbx: Sbx, path: str, expect: int | None = None) -> Timed:
        headers = self._files_headers(sbx)
        t0 = time.perf_counter()
        try:
            resp = await self._http.get("/files", params={"path": path}, headers=headers)
        except httpx.HTTPError as exc:
            raise BenchError(f"read file: {exc}") from None
        ms = (time.perf_counter() - t0) * 1000
        if resp.status_code != 200:
            raise BenchError(f"read file: HTTP {resp.status_code}: {_message(resp)}")
        if expect is not None and len(resp.content) != expect:
            raise BenchError(f"read file: {len(resp.content)} bytes, expected {expect}")
        return Timed(ms, {}, resp.content, 200)

    # -- cleanup ------------------------------------------------------------------------------

    async def cleanup(self) -> list[str]:
        """Removes every sandbox and snapshot this client made (by id, plus any sandbox still
        listed with this run's metadata). Returns what failed, as messages."""
        try:
            listed = await self.list_ids() if self.metadata else []
        except (httpx.HTTPError, ValueError):
            listed = []
        sem = asyncio.Semaphore(16)

        async def one(op: Callable[[str, float], Awaitable[None]], key: str) -> str | None:
            async with sem:
                try:
                    await op(key, CLEANUP_TIMEOUT)
                except BenchError as exc:
                    return str(exc)
                return None

        got = await asyncio.gather(
            *(one(self.kill, sid) for sid in sorted(self.sandboxes | set(listed))),
            *(one(self.delete_snapshot, snap) for snap in sorted(self.snapshots)),
        )
        return [msg for msg in got if msg]


def random_payload(size: int) -> bytes:
    return os.urandom(size)
