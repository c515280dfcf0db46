"""Lifecycle events on a whole node over the fake runtime: what a sandbox's life records
(E2B's types and fields, the kill causes, the pause tier, aenv's own types), the routes'
paging as E2B has it, the retention, and events kept across a restart."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.domain import CreateRequest
from tests.node_harness import Harness, build
from tests.unit.api_node import API_KEY, api_client, assert_error

E2B_FIELDS = {
    "version",
    "id",
    "type",
    "eventData",
    "sandboxBuildId",
    "sandboxExecutionId",
    "sandboxId",
    "sandboxTeamId",
    "sandboxTemplateId",
    "timestamp",
}
LC = "sandbox.lifecycle."


@pytest.fixture
async def client(node: Harness) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(node) as c:
        yield c


async def events_of(c: httpx.AsyncClient, sid: str | None = None, **params: Any) -> Any:
    path = "/events/sandboxes" + (f"/{sid}" if sid else "")
    r = await c.get(path, params=params)
    assert r.status_code == 200, r.text
    return r.json()


async def test_a_sandboxs_life_is_recorded_in_e2bs_shape(
    node: Harness, client: httpx.AsyncClient
) -> None:
    r = await client.post("/sandboxes", json={"templateID": "base", "metadata": {"run": "7"}})
    sid = r.json()["sandboxID"]
    node.clock.advance(1)
    assert (await client.post(f"/sandboxes/{sid}/timeout", json={"timeout": 120})).is_success
    assert (await client.post(f"/sandboxes/{sid}/pause")).status_code == 204
    node.clock.advance(1)
    assert (await client.post(f"/sandboxes/{sid}/connect", json={"timeout": 60})).is_success
    snap = await client.post(f"/sandboxes/{sid}/snapshots", json={})
    assert snap.is_success, snap.text
    fork = await client.post(f"/sandboxes/{sid}/fork", json={"count": 1})
    assert fork.is_success, fork.text
    node.clock.advance(2)
    assert (await client.delete(f"/sandboxes/{sid}")).status_code == 204

    got = await events_of(client, sid, orderAsc="true", limit=100)
    assert [e["type"] for e in got] == [
        LC + "created",
        LC + "updated",
        LC + "paused",
        LC + "resumed",
        LC + "checkpointed",
        LC + "forked",
        LC + "killed",
    ]
    for e in got:
        assert set(e) == E2B_FIELDS
        assert e["sandboxId"] == sid and e["sandboxTemplateId"] == "base"
        assert e["eventData"]["sandbox_metadata"] == {"run": "7"}
    assert len({e["id"] for e in got}) == len(got)
    assert len({e["sandboxExecutionId"] for e in got}) == 1
    created, updated, paused, _resumed, checkpointed, forked, killed = got
    assert created["timestamp"] == "2026-01-01T00:00:00Z"
    assert updated["eventData"]["set_timeout"] == "2026-01-01T00:02:01Z"
    assert paused["eventData"]["pause_tier"] == "frozen"
    assert paused["eventData"]["execution"]["memory_mb"] == 512
    assert checkpointed["eventData"]["snapshot_id"] == snap.json()["snapshotID"]
    child = fork.json()[0]["sandbox"]["sandboxID"]
    assert forked["eventData"]["children"] == [child]
    assert killed["eventData"]["kill_reason"] == "request"
    assert killed["eventData"]["execution"]["execution_time"] == 4000
    # Newest first by default; the child's own life is its own.
    assert (await events_of(client, sid))[0]["type"] == LC + "killed"
    assert [e["type"] for e in await events_of(client, child)] == [LC + "created"]


async def test_paging_order_and_types_as_e2b_has_them(
    node: Harness, client: httpx.AsyncClient
) -> None:
    ids = []
    for _ in range(12):
        node.clock.advance(1)
        ids.append((await node.orch.sandboxes.create(CreateRequest(memory_mb=128))).sandbox_id)
    await node.orch.pauser.pause(ids[0])

    assert len(await events_of(client)) == 10  # E2B's default limit
    newest = await events_of(client, limit=3)
    assert [e["type"] for e in newest] == [LC + "paused", LC + "created", LC + "created"]
    assert [e["sandboxId"] for e in newest[1:]] == [ids[11], ids[10]]
    oldest = await events_of(client, orderAsc="true", offset=1, limit=2)
    assert [e["sandboxId"] for e in oldest] == [ids[1], ids[2]]
    paused = await events_of(client, types=LC + "paused")
    assert [e["sandboxId"] for e in paused] == [ids[0]]
    both = await events_of(client, sid=ids[0], types=[LC + "paused", LC + "created"])
    assert len(both) == 2
    assert len(await events_of(client, types=f"{LC}paused,{LC}killed", limit=100)) == 1
    assert await events_of(client, "no-such-sandbox") == []

    for bad in ({"limit": 101}, {"limit": 0}, {"offset": -1}, {"types": "sandbox.nope"}):
        assert_error(await client.get("/events/sandboxes", params=bad), 400)


async def test_timeouts_and_deaths_say_why(node: Harness, client: httpx.AsyncClient) -> None:
    timed = await node.orch.sandboxes.create(CreateRequest(timeout=10))
    paused = await node.orch.sandboxes.create(CreateRequest(timeout=10, auto_pause=True))
    dies = await node.orch.sandboxes.create(CreateRequest())
    node.clock.advance(11)
    await node.orch.node.tick()
    assert dies.instance is not None
    node.host.kill(dies.instance.id, cause="the host killed it at its memory limit (512 MiB)")
    await node.orch.liveness.sweep()

    (killed,) = await events_of(client, timed.sandbox_id, types=LC + "killed")
    assert killed["eventData"]["kill_reason"] == "timeout"
    (auto,) = await events_of(client, paused.sandbox_id, types=LC + "paused")
    assert auto["eventData"]["auto_pause"] is True
    (oom,) = await events_of(client, dies.sandbox_id, types=LC + "killed")
    assert oom["eventData"]["kill_reason"] == "oom"


async def test_events_are_kept_for_the_retention_then_forgotten(
    node: Harness, client: httpx.AsyncClient
) -> None:
    old = await node.orch.sandboxes.create(CreateRequest())
    node.clock.advance(6 * 86400)
    new = await node.orch.sandboxes.create(CreateRequest())
    assert len(await events_of(client)) == 2
    node.clock.advance(1 * 86400 + 60)  # the first is now 7 days and a minute old
    await node.orch.events.prune()
    assert [e["sandboxId"] for e in await events_of(client)] == [new.sandbox_id]
    assert await events_of(client, old.sandbox_id) == []


async def test_events_survive_a_restart(tmp_path: Path) -> None:
    h = build(tmp_path, api_key=API_KEY)
    await h.orch.start(timers=False)
    r = await h.orch.sandboxes.create(CreateRequest())
    await h.orch.sandboxes.kill(r.sandbox_id)
    await h.orch.close()
    h2 = await h.restart(api_key=API_KEY)
    await h2.orch.start(timers=False)
    try:
        async with api_client(h2) as c:
            got = await events_of(c, r.sandbox_id, orderAsc="true")
        assert [e["type"] for e in got] == [LC + "created", LC + "killed"]
    finally:
        await h2.orch.close()
        h2.catalog.close()


async def test_a_sandbox_lost_across_a_restart_is_recorded_killed(tmp_path: Path) -> None:
    h = build(tmp_path, api_key=API_KEY)
    await h.orch.start(timers=False)
    r = await h.orch.sandboxes.create(CreateRequest())
    assert r.instance is not None
    h.host.kill(r.instance.id)
    h2 = await h.restart(api_key=API_KEY)  # kill -9 of the server: no close()
    await h2.orch.start(timers=False)
    try:
        async with api_client(h2) as c:
            (killed,) = await events_of(c, r.sandbox_id, types=LC + "killed")
        assert killed["eventData"]["kill_reason"] == "lost"
    finally:
        await h2.orch.close()
        h2.catalog.close()
