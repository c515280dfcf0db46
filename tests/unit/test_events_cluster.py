"""Lifecycle events and webhooks through a gateway: two real nodes (the orchestrator over
the fake runtime) and a gateway on loopback over a real redis-server. Events listed
through the gateway are both nodes' merged in E2B's paging; a webhook registered there is
every node's, and each event reaches the receiver once; a sandbox lost with its node is
recorded killed once, however many requests find it gone."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.cluster.records import NodeRecord
from aenv.cluster.state import ClusterState
from aenv.config import Settings
from aenv.domain import CreateRequest
from aenv.server import gateway_app, node_app
from tests.helpers import RedisServer, heard_ago, redis_server, uvicorn_task
from tests.node_harness import Harness, started
from tests.unit.api_node import API_KEY
from tests.webhook_receiver import receiving

LC = "sandbox.lifecycle."
FAST: dict[str, Any] = {"webhook_backoff": 0.05, "webhook_backoff_max": 0.2}


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as srv:
        yield srv


def record(node_id: str, port: int) -> NodeRecord:
    return NodeRecord(
        node_id=node_id,
        url=f"http://127.0.0.1:{port}",
        cpu_count=8,
        memory_total_mb=8192,
        memory_budget_mb=8192,
    )


@contextlib.asynccontextmanager
async def cluster(
    srv: RedisServer, tmp: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, Harness, Harness, ClusterState]]:
    state = ClusterState(srv.url)
    try:
        async with contextlib.AsyncExitStack() as stack:
            nodes = []
            for name in ("na", "nb"):
                gen = started(tmp / name, api_key=API_KEY, **FAST)
                stack.push_async_callback(gen.aclose)  # type: ignore[attr-defined]
                h = await gen.__anext__()
                port = await stack.enter_async_context(
                    uvicorn_task(node_app(h.settings, h.orch), lifespan="off")
                )
                await state.heartbeat(record(name, port), {}, None)
                nodes.append(h)
            settings = Settings(home=tmp / "gw", redis_url=srv.url, api_key=API_KEY)
            pg = await stack.enter_async_context(uvicorn_task(gateway_app(settings), lifespan="on"))
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{pg}", headers={"X-API-Key": API_KEY})
            )
            yield client, nodes[0], nodes[1], state
    finally:
        await state.close()


async def test_events_and_webhooks_through_a_gateway(redis: RedisServer, tmp_path: Path) -> None:
    async with cluster(redis, tmp_path) as (client, a, b, state):
        with receiving() as rcv:
            made = await client.post(
                "/events/webhooks",
                json={"name": "all", "url": rcv.url, "signatureSecret": rcv.secret},
            )
            assert made.status_code == 201, made.text
            wid = made.json()["id"]
            # Every node keeps it, under the same id.
            for h in (a, b):
                assert (await h.orch.events.webhook(wid)).url == rcv.url
            ids = []
            for i, h in enumerate((a, b, a, b)):
                h.clock.now = a.clock.now.replace(minute=0, second=i + 1)  # one clock apart
                ids.append((await h.orch.sandboxes.create(CreateRequest(memory_mb=128))).sandbox_id)
            got = await asyncio.to_thread(rcv.wait_for, 4)
            await asyncio.sleep(0.3)
            assert sorted(e["sandboxId"] for e in rcv.events()) == sorted(ids)  # each once
            assert all(r.signed for r in rcv.accepted)

            r = await client.get("/events/sandboxes", params={"orderAsc": "true", "limit": 3})
            assert [e["sandboxId"] for e in r.json()] == ids[:3]
            r = await client.get("/events/sandboxes", params={"offset": 1, "limit": 2})
            assert [e["sandboxId"] for e in r.json()] == [ids[2], ids[1]]
            r = await client.get(f"/events/sandboxes/{ids[1]}")
            assert [e["id"] for e in r.json()] == [e["id"] for e in got if e["sandboxId"] == ids[1]]
            assert (await client.get("/events/sandboxes", params={"limit": 101})).status_code == 400

            stats = (await client.get(f"/events/webhooks/{wid}/stats")).json()
            assert stats["delivered"] == 4 and stats["backlog"] == 0
            hist = (await client.get(f"/events/webhooks/{wid}/deliveries")).json()
            assert len(hist) == 4

            # Changed and deleted through the gateway: on every node, and in Redis for a
            # node that was away.
            r = await client.patch(f"/events/webhooks/{wid}", json={"enabled": False})
            assert r.json()["enabled"] is False
            assert not (await b.orch.events.webhook(wid)).enabled
            assert (await client.delete(f"/events/webhooks/{wid}")).status_code == 200
            docs, deleted = await state.webhooks()
            assert wid not in docs and wid in deleted
            assert await a.orch.events.webhooks() == []


async def test_a_node_that_was_away_takes_the_clusters_webhooks(
    redis: RedisServer, tmp_path: Path
) -> None:
    async with cluster(redis, tmp_path) as (client, a, b, state):
        made = await client.post("/events/webhooks", json={"name": "n", "url": "http://x/"})
        wid = made.json()["id"]
        await b.orch.events.delete_webhook(wid)  # as if b had missed it
        await b.orch.events.sync(*await state.webhooks())  # its next heartbeat
        assert (await b.orch.events.webhook(wid)).secret == made.json()["signatureSecret"]


async def test_a_sandbox_lost_with_its_node_is_recorded_once(
    redis: RedisServer, tmp_path: Path
) -> None:
    async with cluster(redis, tmp_path) as (client, a, _b, state):
        await state.bind("gone1", "nc")
        await state.heartbeat(record("nc", 1), {}, None)  # a node that stops answering
        await heard_ago(state, "nc", 60)
        for _ in range(3):
            assert (await client.get("/sandboxes/gone1")).status_code == 502
        r = await client.get("/events/sandboxes/gone1")
        (killed,) = r.json()
        assert killed["type"] == LC + "killed"
        assert killed["eventData"] == {"kill_reason": "node_lost", "node_id": "nc"}
