"""The node's connections to its sandboxes' envd: one HTTP pool that every call shares, and
a client (`aenv.envd_client`) per sandbox address when a part calls."""

from __future__ import annotations

import httpx

from ..envd_client import EnvdClient, EnvdTarget

# envd is a hop away on a local veth: a connection that is not made at once will not be.
_TIMEOUT = 10.0
_CONNECT_TIMEOUT = 1.0


class EnvdPool:
    def __init__(self) -> None:
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(_TIMEOUT, connect=_CONNECT_TIMEOUT))

    def at(self, host: str, token: str | None = None) -> EnvdClient:
        """The envd at `host` (a sandbox's address on its network slot), calls carrying
        `token` — the one envd holds now."""
        return EnvdClient(EnvdTarget.direct(host, token or None), self._http, timeout=_TIMEOUT)

    async def close(self) -> None:
        await self._http.aclose()
