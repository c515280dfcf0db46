"""The node's client for envd: /health, /init, /logs, and (`EnvdClient.rpc`) processes and files."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from ..envd_wire import (
    FILESYSTEM_MAKE_DIR,
    PROCESS_START,
    ProcessEvent,
    StreamReader,
    WireError,
    auth_headers,
    call_headers,
    encode_envelope,
    error_code,
    parse_process_event,
    start_request,
)
from ..errors import GatewayTimeout, RuntimeFailure

__all__ = ["EnvdClient", "EnvdRpc", "ProcessEvent", "SandboxProcessError"]


class EnvdClient:
    def __init__(self) -> None:
        # Short connect timeouts: envd is a hop away on a local veth.
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=1.0))

    async def close(self) -> None:
        await self._http.aclose()

    def rpc(self, host: str, port: int, token: str) -> EnvdRpc:
        """Process/filesystem calls to the envd at `host:port` (sharing this client's pool)."""
        return EnvdRpc(self._http, host, port, token)

    async def wait_ready(self, host: str, port: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.002
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                resp = await self._http.get(f"http://{host}:{port}/health", timeout=1.0)
                if resp.status_code < 300:
                    return
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.05)
        raise GatewayTimeout(
            f"envd at {host}:{port} did not become ready in {timeout:.0f}s ({last})"
        )

    async def healthy(self, host: str, port: int, timeout: float = 2.0) -> bool:
        """Whether envd answers its health check now (one try, within `timeout`)."""
        try:
            resp = await self._http.get(f"http://{host}:{port}/health", timeout=timeout)
        except httpx.HTTPError:
            return False
        return resp.status_code < 300

    async def init(
        self,
        host: str,
        port: int,
        *,
        token: str,
        env_vars: dict[str, str],
        user: str | None,
        workdir: str | None,
        current_token: str | None = None,
    ) -> None:
        body: dict[str, object] = {"envVars": env_vars}
        if token:
            body["accessToken"] = token
        if user:
            body["defaultUser"] = user
        if workdir:
            body["defaultWorkdir"] = workdir
        resp = await self._http.post(
            f"http://{host}:{port}/init", json=body, headers=auth_headers(current_token)
        )
        if resp.status_code >= 300:
            raise RuntimeFailure(f"envd /init failed: {resp.status_code} {resp.text[:200]}")

    async def logs(self, host: str, port: int, *, token: str, after: int) -> dict[str, Any]:
        """envd's journal entries after sequence number `after` (`envd/journal.py`)."""
        resp = await self._http.get(
            f"http://{host}:{port}/logs",
            params={"after": str(after)},
            headers=auth_headers(token or None),
            timeout=2.0,
        )
        if resp.status_code >= 300:
            raise RuntimeFailure(f"envd /logs failed: {resp.status_code} {resp.text[:200]}")
        body = resp.json()
        if not isinstance(body, dict):
            raise RuntimeFailure("envd /logs answered something other than an object")
        return body

    async def kill_largest(self, host: str, port: int, *, token: str) -> dict[str, Any] | None:
        """Has envd kill the sandbox's largest process (`envd/oomkill.py`); what it was, or
        None when there was none to kill."""
        resp = await self._http.post(
            f"http://{host}:{port}/oom", headers=auth_headers(token or None), timeout=5.0
        )
        if resp.status_code >= 300:
            raise RuntimeFailure(f"envd /oom failed: {resp.status_code} {resp.text[:200]}")
        killed = resp.json().get("killed")
        return killed if isinstance(killed, dict) else None

    async def forward(self, host: str, port: int, *, token: str, target: int) -> bool:
        """Asks envd to make loopback-only port `target` reachable (`envd/portfwd.py`);
        whether it now is."""
        resp = await self._http.post(
            f"http://{host}:{port}/forward",
            params={"port": str(target)},
            headers=auth_headers(token or None),
            timeout=2.0,
        )
        if resp.status_code == 404:
            return False  # an envd from before on-demand forwarding: it polls on its own
        if resp.status_code >= 300:
            raise RuntimeFailure(f"envd /forward failed: {resp.status_code} {resp.text[:200]}")
        return bool(resp.json().get("forwarded"))


# Connect-RPC calls into a sandbox (process.Process/Start, filesystem MakeDir, /files upload),
# for work the node itself does inside sandboxes (template builds, image entrypoints).


class SandboxProcessError(RuntimeFailure):
    """envd refused or broke off a process call (not: the process failed)."""


class EnvdRpc:
    """Process and filesystem calls to one sandbox's envd (`host:port` on the node)."""

    def __init__(self, http: httpx.AsyncClient, host: str, port: int, token: str) -> None:
        self._http = http
        self.base = f"http://{host}:{port}"
        self.token = token

    async def process(
        self,
        cmd: str,
        args: list[str],
        *,
        user: str | None = None,
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[ProcessEvent]:
        """Starts a process and yields its events until `end`. Leaving the iteration early
        (or cancelling the consumer) only disconnects: the process keeps running."""
        headers = {
            **auth_headers(self.token, user),
            **call_headers(stream=True, timeout_ms=int(timeout * 1000) if timeout else None),
        }
        body = encode_envelope(start_request(cmd, args, envs=envs, cwd=cwd))
        reader = StreamReader()
        try:
            async with self._http.stream(
                "POST",
                f"{self.base}/{PROCESS_START}",
                content=body,
                headers=headers,
                timeout=httpx.Timeout(10.0, read=None),
            ) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise SandboxProcessError(_rpc_error_text(resp))
                async for chunk in resp.aiter_bytes():
                    for message in reader.feed(chunk):
                        event = parse_process_event(message)
                        if event is not None:
                            yield event
                    if reader.ended:
                        return
        except WireError as e:
            raise SandboxProcessError(str(e)) from e
        except httpx.HTTPError as e:
            raise SandboxProcessError(f"envd process stream failed: {e}") from e

    async def run(
        self,
        cmd: str,
        args: list[str],
        *,
        user: str | None = None,
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
    ) -> ProcessEvent:
        """Runs a process to its end; returns the `end` event (exit code, status)."""
        async for ev in self.process(cmd, args, user=user, envs=envs, cwd=cwd, timeout=timeout):
            if ev.kind in ("stdout", "stderr") and on_output is not None:
                on_output(ev.kind, ev.data)
            elif ev.kind == "end":
                return ev
        raise SandboxProcessError(f"the process stream of {cmd} ended without an end event")

    async def make_dir(self, path: str, *, user: str | None = None) -> bool:
        """mkdir -p (new directories belong to `user`); False when it existed."""
        resp = await self._unary(FILESYSTEM_MAKE_DIR, {"path": path}, user)
        if resp.status_code == 200:
            return True
        if error_code(resp.status_code, resp.content) == "already_exists":
            return False
        raise SandboxProcessError(f"making directory {path}: {_rpc_error_text(resp)}")

    async def upload(
        self, path: str, content: AsyncIterator[bytes] | bytes, *, user: str = "root"
    ) -> None:
        """Writes a file (parents created) through envd's `/files` (raw body)."""
        try:
            resp = await self._http.post(
                f"{self.base}/files",
                params={"path": path, "username": user},
                content=content,
                headers={**auth_headers(self.token), "Content-Type": "application/octet-stream"},
                timeout=httpx.Timeout(60.0, read=600.0),
            )
        except httpx.HTTPError as e:
            raise SandboxProcessError(f"uploading {path} into the sandbox failed: {e}") from e
        if resp.status_code >= 300:
            raise SandboxProcessError(f"uploading {path}: {_rpc_error_text(resp)}")

    async def read_file(self, path: str, *, user: str = "root") -> bytes | None:
        """A file's content through `/files`; None when it does not exist."""
        try:
            resp = await self._http.get(
                f"{self.base}/files",
                params={"path": path, "username": user},
                headers=auth_headers(self.token),
            )
        except httpx.HTTPError as e:
            raise SandboxProcessError(f"reading {path} in the sandbox failed: {e}") from e
        if resp.status_code == 404:
            return None
        if resp.status_code >= 300:
            raise SandboxProcessError(f"reading {path}: {_rpc_error_text(resp)}")
        return resp.content

    async def _unary(
        self, method: str, message: dict[str, Any], user: str | None
    ) -> httpx.Response:
        try:
            return await self._http.post(
                f"{self.base}/{method}",
                content=json.dumps(message).encode(),
                headers={**auth_headers(self.token, user), **call_headers(stream=False)},
            )
        except httpx.HTTPError as e:
            raise SandboxProcessError(f"envd {method} failed: {e}") from e


def _rpc_error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("message"):
        return f"{body['message']} ({resp.status_code})"
    return f"{resp.status_code} {resp.text[:200]}".strip()
