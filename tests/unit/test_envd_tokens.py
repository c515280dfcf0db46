"""Every sandbox's envd wants an access token (issue 10, part 8): the v1 create without
`secure` (or with `secure: false`), v2, the warm pool's sandboxes and fork children each get
their own, the node initialises envd with it, and the create response hands it to the SDK.

The real API app over the whole orchestrator (fake runtime and envd, tests/node_harness.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.server import node_app
from tests.node_harness import Harness, started

KEY = "test-key"


async def _api(h: Harness) -> AsyncIterator[httpx.AsyncClient]:
    app = node_app(h.settings, h.orch)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://test",
        headers={"X-API-Key": KEY},
    ) as c:
        yield c


def _init_token(h: Harness, sandbox_id: str) -> str:
    """The token the node last gave this sandbox's envd in /init."""
    address = h.orch.table.get(sandbox_id).address
    tokens = [kw["token"] for host, kw in h.envd.inits if host == address]
    assert tokens, f"envd of {sandbox_id} was never initialised"
    return str(tokens[-1])


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/sandboxes", {}),
        ("/sandboxes", {"secure": False}),
        ("/sandboxes", {"secure": True}),
        ("/v2/sandboxes", {}),
    ],
)
async def test_every_create_gets_an_envd_token(
    tmp_path: Path, path: str, extra: dict[str, Any]
) -> None:
    async for h in started(tmp_path, api_key=KEY):
        async for api in _api(h):
            created = []
            for _ in range(2):
                r = await api.post(path, json={"templateID": "base", **extra})
                assert r.status_code == 201, r.text
                created.append(r.json())
            tokens = [s["envdAccessToken"] for s in created]
            assert all(isinstance(t, str) and len(t) >= 24 for t in tokens)
            assert tokens[0] != tokens[1]
            for s in created:
                assert _init_token(h, s["sandboxID"]) == s["envdAccessToken"]
                info = (await api.get(f"/sandboxes/{s['sandboxID']}")).json()
                assert info["envdAccessToken"] == s["envdAccessToken"]


async def test_pool_sandbox_and_fork_children_get_their_own_tokens(tmp_path: Path) -> None:
    async for h in started(tmp_path, api_key=KEY, sandbox_pool_size=1):
        for _ in range(200):  # the pool boots in the background
            if h.runtime.instances():
                break
            await asyncio.sleep(0.01)
        async for api in _api(h):
            r = await api.post("/sandboxes", json={"templateID": "base"})
            assert r.status_code == 201, r.text
            parent = r.json()
            assert h.runtime.ops().count("create") == 1  # it was the pre-booted one
            assert parent["envdAccessToken"]
            assert _init_token(h, parent["sandboxID"]) == parent["envdAccessToken"]

            r = await api.post(f"/sandboxes/{parent['sandboxID']}/fork", json={"count": 2})
            assert r.status_code == 201, r.text
            kids = [h.orch.table.get(res["sandbox"]["sandboxID"]) for res in r.json()]
            assert all(res["sandbox"]["envdAccessToken"] for res in r.json())
            tokens = {k.envd_access_token for k in kids}
            assert len(tokens) == 2 and "" not in tokens
            assert parent["envdAccessToken"] not in tokens
            for k in kids:
                assert _init_token(h, k.sandbox_id) == k.envd_access_token
