"""The one client of envd, async over httpx: the node's calls straight to a sandbox's address
and the CLI's calls through the aenv server's port differ only in their `EnvdTarget`.

Every request to envd is built here and every answer read here; the wire format itself
(envelopes, Connect headers, process events) is `envd_wire`'s. Failures are `EnvdError`
(`envd_errors`), whatever their layer (an envd or proxy answer, a broken stream, no connection), so the node
and the CLI each map one type to their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import IO, Any

import httpx

from .envd_errors import EnvdError, EnvdUnreachable
from .envd_wire import (
    ENVD_PORT,
    FILESYSTEM_MAKE_DIR,
    PROCESS_START,
    ProcessEvent,
    StreamReader,
    WireError,
    auth_headers,
    call_headers,
    encode_envelope,
    error_from_json,
    parse_process_event,
    route_headers,
    start_request,
)
from .errors import GatewayTimeout

__all__ = ["EnvdClient", "EnvdTarget", "ProcessEvent"]

# Asked of envd on every stream: a shell that prints nothing for minutes is still alive, and
# proxies in between do not cut an idle connection.
_KEEPALIVE = {"Keepalive-Ping-Interval": "50"}
# `_json`'s markers: no answer for a missing route was given; the route was missing.
_REQUIRED, _MISSING = object(), object()


@dataclass(frozen=True)
class EnvdTarget:
    """Where one sandbox's envd is and what addresses a request to it: the base URL requests
    go to and the headers every one carries (the access token; route headers when the aenv
    server's port stands in between). `name` is what messages call the far end; `verify`
    is for a client that makes its own pool."""

    url: str
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    name: str = ""
    verify: ssl.SSLContext | bool = True

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", f"envd at {self.url}")

    @classmethod
    def direct(cls, host: str, token: str | None = None, *, port: int = ENVD_PORT) -> EnvdTarget:
        """The node's way: straight to envd on the sandbox's network slot."""
        return cls(f"http://{host}:{port}", MappingProxyType(auth_headers(token)))

    @classmethod
    def routed(
        cls,
        server_url: str,
        sandbox_id: str,
        token: str | None,
        *,
        port: int = ENVD_PORT,
        headers: Mapping[str, str] | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> EnvdTarget:
        """Through the aenv server's one port (the CLI's way): the route headers name the
        sandbox and the port inside it."""
        url = server_url.rstrip("/")
        return cls(
            url,
            MappingProxyType(
                {**(headers or {}), **route_headers(sandbox_id, port), **auth_headers(token)}
            ),
            f"the aenv server at {url}",
            verify,
        )


class EnvdClient:
    """Calls to one sandbox's envd. `http` is a pool to share (the node's, left open by
    `aclose`); without one the client makes its own. `user` is whom calls run as unless a
    call names another; `timeout` bounds each step of a request (reads of streams and file
    bodies excepted: a quiet process or a slow disk is not a dead envd)."""

    def __init__(
        self,
        target: EnvdTarget,
        http: httpx.AsyncClient | None = None,
        *,
        user: str | None = None,
        timeout: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.target = target
        self.user = user
        self.timeout = timeout
        self._own = http is None
        self._http = http or httpx.AsyncClient(
            timeout=timeout, verify=target.verify, transport=transport
        )

    async def aclose(self) -> None:
        if self._own:
            await self._http.aclose()

    async def __aenter__(self) -> EnvdClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- plumbing ---------------------------------------------------------------------------

    def _headers(
        self, user: str | None = None, extra: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        return {**self.target.headers, **auth_headers(None, user or self.user), **(extra or {})}

    async def _send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        try:
            return await self._http.send(request, stream=stream)
        except httpx.TransportError as e:
            raise self._unreachable(e) from e

    def _unreachable(self, e: httpx.TransportError) -> EnvdUnreachable:
        where, reason = self.target.name, str(e) or type(e).__name__
        if isinstance(e, httpx.TimeoutException):
            return EnvdUnreachable("deadline_exceeded", f"timed out talking to {where}: {reason}")
        return EnvdUnreachable("unavailable", f"cannot reach {where}: {reason}")

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Request:
        return self._http.build_request(method, f"{self.target.url}/{path}", **kw)

    def _file_params(self, path: str, user: str | None) -> dict[str, str]:
        who = user or self.user
        return {"path": path, "username": who} if who else {"path": path}

    # -- Connect calls ----------------------------------------------------------------------

    async def unary(
        self, method: str, message: Mapping[str, Any], *, user: str | None = None
    ) -> dict[str, Any]:
        """`method` is `package.Service/Method`, e.g. `process.Process/SendInput`."""
        resp = await self._send(
            self._request(
                "POST",
                method,
                content=json.dumps(message, separators=(",", ":")).encode(),
                headers=self._headers(user, call_headers(stream=False)),
            )
        )
        if resp.status_code != 200:
            raise EnvdError.answer(resp)
        try:
            data = resp.json()
        except ValueError:
            raise EnvdError("internal", f"{method}: the answer is not JSON") from None
        return data if isinstance(data, dict) else {}

    async def stream(
        self,
        method: str,
        message: Mapping[str, Any],
        *,
        user: str | None = None,
        timeout_ms: int | None = None,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """A server-streaming call: each message as it arrives. Leaving the iteration early
        only disconnects (a process keeps running)."""
        request = self._request(
            "POST",
            method,
            content=encode_envelope(message),
            headers=self._headers(
                user, {**call_headers(stream=True, timeout_ms=timeout_ms), **_KEEPALIVE}
            ),
            timeout=httpx.Timeout(self.timeout, read=None),
        )
        resp = await self._send(request, stream=True)
        reader = StreamReader()
        try:
            if resp.status_code != 200:
                await resp.aread()
                raise EnvdError.answer(resp)
            if resp.headers.get("content-type", "").startswith("application/json"):
                # A unary-style error with status 200 is not valid Connect, but say what it is.
                await resp.aread()
                raise EnvdError.of(error_from_json(_json_or_none(resp.content)))
            async for chunk in resp.aiter_bytes():
                for msg in reader.feed(chunk):
                    yield msg
                if reader.ended:
                    return
        except WireError as e:
            raise EnvdError.of(e) from None
        except httpx.TransportError as e:
            raise self._unreachable(e) from e
        finally:
            await resp.aclose()
        raise EnvdError("unavailable", f"{method}: stream ended without an end-of-stream message")

    async def events(
        self,
        method: str,
        message: Mapping[str, Any],
        *,
        user: str | None = None,
        timeout_ms: int | None = None,
    ) -> AsyncGenerator[ProcessEvent, None]:
        """The events of a process stream (`process.Process/Start` or `Connect`)."""
        async for msg in self.stream(method, message, user=user, timeout_ms=timeout_ms):
            try:
                event = parse_process_event(msg)
            except WireError as e:
                raise EnvdError.of(e) from None
            if event is not None:
                yield event

    def process(
        self,
        cmd: str,
        args: list[str],
        *,
        user: str | None = None,
        envs: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
    ) -> AsyncGenerator[ProcessEvent, None]:
        """Starts a process and yields its events until `end`."""
        return self.events(
            PROCESS_START,
            start_request(cmd, args, envs=envs, cwd=cwd),
            user=user,
            timeout_ms=int(timeout * 1000) if timeout else None,
        )

    async def run(
        self,
        cmd: str,
        args: list[str],
        *,
        user: str | None = None,
        envs: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
    ) -> ProcessEvent:
        """Runs a process to its end; returns the `end` event (exit code, status)."""
        events = self.process(cmd, args, user=user, envs=envs, cwd=cwd, timeout=timeout)
        # Closed on return: the end event comes before the stream's own end.
        async with contextlib.aclosing(events):
            async for ev in events:
                if ev.kind in ("stdout", "stderr") and on_output is not None:
                    on_output(ev.kind, ev.data)
                elif ev.kind == "end":
                    return ev
        raise EnvdError("unavailable", f"the process stream of {cmd} ended without an end event")

    async def make_dir(self, path: str, *, user: str | None = None) -> bool:
        """mkdir -p (new directories belong to `user`); False when it existed."""
        try:
            await self.unary(FILESYSTEM_MAKE_DIR, {"path": path}, user=user)
        except EnvdError as e:
            if e.code == "already_exists":
                return False
            raise
        return True

    # -- files (envd's /files, plain HTTP beside the RPCs) ----------------------------------

    async def upload(
        self,
        path: str,
        content: bytes | AsyncIterator[bytes] | IO[bytes],
        *,
        user: str | None = None,
        filename: str | None = None,
    ) -> None:
        """`POST /files?path=`: writes a file, its parents created. With `filename` the body
        is one multipart part as E2B's SDK sends it (`content` a file, streamed); without, the
        raw bytes."""
        kw: dict[str, Any]
        if filename is not None:
            kw = {"files": {"file": (filename, content, "application/octet-stream")}}
            headers = self._headers(user)
        else:
            kw = {"content": content}
            headers = self._headers(user, {"Content-Type": "application/octet-stream"})
        resp = await self._send(
            self._request(
                "POST",
                "files",
                params=self._file_params(path, user),
                headers=headers,
                timeout=httpx.Timeout(self.timeout, write=None, read=_FILE_READ),
                **kw,
            )
        )
        if resp.status_code >= 300:
            raise EnvdError.answer(resp, path)

    async def download(
        self, path: str, *, user: str | None = None, chunk_size: int | None = None
    ) -> AsyncGenerator[bytes, None]:
        """`GET /files?path=`: the file's bytes as they arrive (a missing file: `EnvdError`
        with code "not_found")."""
        request = self._request(
            "GET",
            "files",
            params=self._file_params(path, user),
            # Bytes as they are: no gzip work for envd, and sizes stay true.
            headers=self._headers(user, {"Accept-Encoding": "identity"}),
            timeout=httpx.Timeout(self.timeout, read=_FILE_READ),
        )
        resp = await self._send(request, stream=True)
        try:
            if resp.status_code != 200:
                await resp.aread()
                raise EnvdError.answer(resp, path)
            async for chunk in resp.aiter_bytes(chunk_size):
                yield chunk
        except httpx.TransportError as e:
            raise self._unreachable(e) from e
        finally:
            await resp.aclose()

    # -- envd's own routes, for the node ----------------------------------------------------

    async def healthy(self, timeout: float = 2.0) -> bool:
        """Whether envd answers its health check now (one try, within `timeout`)."""
        try:
            resp = await self._send(self._request("GET", "health", timeout=timeout))
        except EnvdUnreachable:
            return False
        return resp.status_code < 300

    async def wait_ready(self, timeout: float = 20.0) -> None:
        """Until envd answers its health check; `GatewayTimeout` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        delay = 0.002
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                resp = await self._send(self._request("GET", "health", timeout=1.0))
                if resp.status_code < 300:
                    return
                last = f"HTTP {resp.status_code}"
            except EnvdUnreachable as e:
                cause = e.__cause__
                last = f"{type(cause).__name__}: {cause}" if cause else str(e)
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.05)
        raise GatewayTimeout(
            f"envd at {self.target.url} did not become ready in {timeout:.0f}s ({last})"
        )

    async def init(
        self,
        *,
        token: str,
        env_vars: Mapping[str, str],
        user: str | None,
        workdir: str | None,
        sandbox_id: str | None = None,
    ) -> None:
        """Gives envd the sandbox's (new) access token, environment, default user and working
        directory; the target's token is the one envd holds now. A `sandbox_id` envd was not
        initialised for before makes it renew the sandbox's identity (envd/identity.py)."""
        body: dict[str, object] = {"envVars": dict(env_vars)}
        if sandbox_id:
            body["sandboxID"] = sandbox_id
        if token:
            body["accessToken"] = token
        if user:
            body["defaultUser"] = user
        if workdir:
            body["defaultWorkdir"] = workdir
        await self._json("POST", "init", json=body)

    async def logs(self, after: int) -> dict[str, Any]:
        """envd's journal entries after sequence number `after` (`envd/journal.py`)."""
        body = await self._json("GET", "logs", params={"after": str(after)}, timeout=2.0)
        if not isinstance(body, dict):
            raise EnvdError("internal", "envd /logs answered something other than an object")
        return body

    async def kill_largest(self, force: bool = False) -> dict[str, Any] | None:
        """Has envd kill the sandbox's largest process (`envd/oomkill.py`) — only while the
        sandbox counts itself short of memory, unless `force`; what it was, or None when
        none was killed."""
        params = {"force": "1"} if force else None
        body = await self._json("POST", "oom", params=params, timeout=8.0)
        killed = body.get("killed") if isinstance(body, dict) else None
        return killed if isinstance(killed, dict) else None

    async def unpack(self, tar: AsyncIterable[bytes]) -> bool:
        """`POST /tree`: envd deletes what the tar's first member lists and unpacks the rest
        at / (`envd/unpack.py`); False for an envd from before the route (404)."""
        resp = await self._send(
            self._request(
                "POST",
                "tree",
                headers=self._headers(None, {"Content-Type": "application/x-tar"}),
                content=tar,
                timeout=httpx.Timeout(self.timeout, write=None, read=_FILE_READ),
            )
        )
        if resp.status_code == 404:
            return False
        if resp.status_code >= 300:
            raise EnvdError.answer(resp, "tree")
        return True

    async def sync(self) -> bool:
        """Has envd flush what the sandbox wrote to its files (`POST /sync`); False for an
        envd from before the route: the caller runs `sync` instead."""
        return await self._json("POST", "sync", missing=_MISSING, timeout=60.0) is not _MISSING

    async def forward(self, port: int) -> bool:
        """Asks envd to make loopback-only `port` reachable (`envd/portfwd.py`); whether it
        now is. An envd from before on-demand forwarding polls on its own: False."""
        params = {"port": str(port)}
        body = await self._json("POST", "forward", missing=None, params=params, timeout=2.0)
        return isinstance(body, dict) and bool(body.get("forwarded"))

    async def _json(self, method: str, path: str, missing: Any = _REQUIRED, **kw: Any) -> Any:
        """A call to one of envd's plain routes; its JSON answer (None for an empty one), or
        `missing` when given and envd is from before the route (404)."""
        resp = await self._send(self._request(method, path, headers=self._headers(), **kw))
        if resp.status_code == 404 and missing is not _REQUIRED:
            return missing
        if resp.status_code >= 300:
            raise EnvdError.answer(resp, f"envd /{path}")
        return _json_or_none(resp.content)


# How long a file body may stay quiet: envd reading or writing a large file on a slow disk.
_FILE_READ = 600.0


def _json_or_none(payload: bytes) -> Any:
    if not payload:
        return None
    try:
        return json.loads(payload)
    except ValueError:
        return None


async def _chunks(f: IO[bytes], size: int = 1 << 20) -> AsyncIterator[bytes]:
    """A file's bytes for an async request body, read off the event loop."""
    while chunk := await asyncio.to_thread(f.read, size):
        yield chunk
