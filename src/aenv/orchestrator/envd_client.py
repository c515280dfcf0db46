"""The node's client for envd's plain-HTTP endpoints (/health, /init)."""

from __future__ import annotations

import asyncio
import time

import httpx

from ..errors import GatewayTimeout, RuntimeFailure


class EnvdClient:
    def __init__(self) -> None:
        # Short connect timeouts: envd is a hop away on a local veth.
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=1.0))

    async def close(self) -> None:
        await self._http.aclose()

    async def wait_ready(self, host: str, port: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.002
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                resp = await self._http.get(f"http://{host}:{port}/health", timeout=1.0)
                if resp.status_code < 300:
                    return
            except httpx.HTTPError as e:
                last = e
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.05)
        raise GatewayTimeout(f"envd at {host}:{port} did not become ready in {timeout:.0f}s: {last}")

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
        headers = {"X-Access-Token": current_token} if current_token else {}
        resp = await self._http.post(f"http://{host}:{port}/init", json=body, headers=headers)
        if resp.status_code >= 300:
            raise RuntimeFailure(f"envd /init failed: {resp.status_code} {resp.text[:200]}")
