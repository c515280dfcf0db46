"""Bulk lifecycle by metadata (api/routes/bulk.py) over a real node on the fake runtime:
each route acts on exactly the matching sandboxes and refuses an empty query."""

from __future__ import annotations

from datetime import datetime, timedelta

import httpx

from aenv.domain import SandboxState as State
from tests.node_harness import Harness
from tests.unit.api_node import assert_error, paused, running


async def test_kill_matching_only(client: httpx.AsyncClient, node: Harness) -> None:
    a = await running(node, metadata={"run": "r1", "k": "x"})
    b = await paused(node, metadata={"run": "r1"})
    other = await running(node, metadata={"run": "r2"})
    bare = await running(node)
    r = await client.delete("/sandboxes", params={"metadata": "run=r1"})
    assert r.status_code == 200
    assert r.json() == {"sandboxIDs": [a.sandbox_id, b.sandbox_id], "failed": []}
    assert_error(await client.get(f"/sandboxes/{a.sandbox_id}"), 404)
    assert_error(await client.get(f"/sandboxes/{b.sandbox_id}"), 404)
    for kept in (other, bare):
        assert (await client.get(f"/sandboxes/{kept.sandbox_id}")).status_code == 200
    # Nothing matches any more: an empty answer, not an error.
    r = await client.delete("/sandboxes", params={"metadata": "run=r1"})
    assert r.json() == {"sandboxIDs": [], "failed": []}


async def test_empty_query_refused(client: httpx.AsyncClient, node: Harness) -> None:
    rec = await running(node, metadata={"run": "r1"})
    for params in ({}, {"metadata": ""}, {"metadata": "  "}):
        assert_error(await client.delete("/sandboxes", params=params), 400)
        assert_error(await client.post("/sandboxes/pause", params=params), 400)
        r = await client.post("/sandboxes/timeout", params=params, json={"timeout": 60})
        assert_error(r, 400)
    assert node.orch.table.get(rec.sandbox_id).state is State.RUNNING


async def test_pause_matching(client: httpx.AsyncClient, node: Harness) -> None:
    a = await running(node, metadata={"run": "r1"})
    already = await paused(node, metadata={"run": "r1"})
    other = await running(node, metadata={"run": "r2"})
    r = await client.post("/sandboxes/pause", params={"metadata": "run=r1"})
    assert r.status_code == 200
    # The paused one is not a match for pause: only running sandboxes are.
    assert r.json() == {"sandboxIDs": [a.sandbox_id], "failed": []}
    states = {
        s["sandboxID"]: s["state"]
        for s in (await client.get("/v2/sandboxes", params={"state": "running,paused"})).json()
    }
    assert states == {
        a.sandbox_id: "paused",
        already.sandbox_id: "paused",
        other.sandbox_id: "running",
    }


async def test_timeout_matching(client: httpx.AsyncClient, node: Harness) -> None:
    a = await running(node, metadata={"run": "r1", "team": "ml"})
    b = await running(node, metadata={"run": "r1"})
    t0 = node.clock.now
    params = {"metadata": "run=r1&team=ml"}
    r = await client.post("/sandboxes/timeout", params=params, json={"timeout": 120})
    assert r.json() == {"sandboxIDs": [a.sandbox_id], "failed": []}

    async def end_at(sid: str) -> timedelta:
        body = (await client.get(f"/sandboxes/{sid}")).json()
        return datetime.fromisoformat(body["endAt"]) - t0

    assert await end_at(a.sandbox_id) == timedelta(seconds=120)
    assert await end_at(b.sandbox_id) != timedelta(seconds=120)
    r = await client.post("/sandboxes/timeout", params=params, json={"timeout": 86401})
    assert_error(r, 400)
    assert_error(await client.post("/sandboxes/timeout", params=params, json={}), 400)


async def test_single_sandbox_routes_unchanged(client: httpx.AsyncClient, node: Harness) -> None:
    """The bulk routes sit beside `/sandboxes/{id}/...`, taking none of their paths."""
    rec = await running(node, metadata={"run": "r1"})
    sid = rec.sandbox_id
    assert (await client.post(f"/sandboxes/{sid}/timeout", json={"timeout": 60})).status_code == 204
    assert (await client.post(f"/sandboxes/{sid}/pause")).status_code == 204
    assert (await client.delete(f"/sandboxes/{sid}")).status_code == 204
