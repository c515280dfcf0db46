"""Webhooks on a whole node over the fake runtime, delivering to a real HTTP receiver on
loopback (`tests/webhook_receiver.py`, which checks E2B's signature): the routes, signed
deliveries in order, retries after the receiver was down (each event delivered once), the
backlog bound, a restart with deliveries pending, a slow receiver that never slows a
sandbox, the delivery history, stats and metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aenv.domain import CreateRequest
from tests.helpers import free_port
from tests.node_harness import Harness, build, started
from tests.unit.api_node import API_KEY, api_client, assert_error
from tests.webhook_receiver import Receiver, receiving

LC = "sandbox.lifecycle."
FAST: dict[str, Any] = {"webhook_backoff": 0.05, "webhook_backoff_max": 0.2, "webhook_timeout": 2.0}


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    async for h in started(tmp_path, api_key=API_KEY, **FAST):
        yield h


@pytest.fixture
async def client(node: Harness) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(node) as c:
        yield c


async def register(c: httpx.AsyncClient, rcv: Receiver, **fields: Any) -> dict[str, Any]:
    body = {"name": "tests", "url": rcv.url, "signatureSecret": rcv.secret, **fields}
    r = await c.post("/events/webhooks", json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


async def wait_for(rcv: Receiver, n: int) -> list[dict[str, Any]]:
    return await asyncio.to_thread(rcv.wait_for, n)


async def life(h: Harness) -> str:
    r = await h.orch.sandboxes.create(CreateRequest())
    await h.orch.pauser.pause(r.sandbox_id)
    await h.orch.pauser.connect(r.sandbox_id, 60)
    await h.orch.sandboxes.kill(r.sandbox_id)
    return r.sandbox_id


async def metric(c: httpx.AsyncClient, name: str, **labels: str) -> float:
    text = (await c.get("/metrics")).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"no {name} {labels}")


async def test_webhooks_are_kept_in_e2bs_shape(client: httpx.AsyncClient) -> None:
    with receiving() as rcv:
        made = await register(client, rcv, events=[LC + "created", LC + "killed"])
        assert set(made) == {"id", "teamId", "name", "createdAt", "enabled", "url", "events"}
        wid = made["id"]
        assert (await client.get(f"/events/webhooks/{wid}")).json() == made
        assert (await client.get("/events/webhooks")).json() == [made]
        r = await client.patch(f"/events/webhooks/{wid}", json={"enabled": False, "events": []})
        assert r.json()["enabled"] is False and r.json()["events"] == []
        # No secret given: the node makes one and shows it once.
        other = await client.post("/events/webhooks", json={"name": "x", "url": rcv.url})
        assert len(other.json()["signatureSecret"]) >= 20
        oid = other.json()["id"]
        assert "signatureSecret" not in (await client.get(f"/events/webhooks/{oid}")).json()
        assert (await client.delete(f"/events/webhooks/{wid}")).status_code == 200
        assert_error(await client.get(f"/events/webhooks/{wid}"), 404)
        assert_error(await client.delete(f"/events/webhooks/{wid}"), 404)
        for bad in ({"url": "ftp://x"}, {"events": ["sandbox.nope"]}, {"url": 3}):
            body = {"name": "bad", "url": rcv.url, **bad}
            assert_error(await client.post("/events/webhooks", json=body), 400)


async def test_deliveries_are_signed_in_order_and_match_the_api(
    node: Harness, client: httpx.AsyncClient
) -> None:
    with receiving() as rcv:
        hook = await register(client, rcv)
        one, two = await life(node), await life(node)
        got = await wait_for(rcv, 8)
        assert all(r.signed for r in rcv.accepted)
        heads = rcv.accepted[0].headers
        assert heads["e2b-webhook-id"] == hook["id"]
        assert heads["e2b-signature-version"] == "v1"
        assert len({r.headers["e2b-delivery-id"] for r in rcv.accepted}) == 8
        for sid in (one, two):
            mine = [e["type"] for e in got if e["sandboxId"] == sid]
            assert mine == [LC + t for t in ("created", "paused", "resumed", "killed")]
        # The body is the event as the API lists it.
        listed = (await client.get("/events/sandboxes", params={"limit": 100})).json()
        assert sorted(listed, key=lambda e: e["id"]) == sorted(got, key=lambda e: e["id"])


async def test_a_receiver_that_was_down_gets_each_event_once_in_order(
    node: Harness, client: httpx.AsyncClient
) -> None:
    with receiving(Receiver(refuse=5)) as rcv:
        hook = await register(client, rcv)
        sid = await life(node)
        got = await wait_for(rcv, 4)
        await asyncio.sleep(0.3)  # nothing more comes: each event exactly once
        assert [e["type"] for e in rcv.events()] == [
            LC + t for t in ("created", "paused", "resumed", "killed")
        ]
        assert {e["sandboxId"] for e in got} == {sid}
        assert rcv.refused == 5
        history = (await client.get(f"/events/webhooks/{hook['id']}/deliveries?limit=100")).json()
        outcomes = [d["outcome"] for d in reversed(history)]
        assert outcomes == ["failed"] * 5 + ["delivered"] * 4
        assert history[-1]["statusCode"] == 503 and history[-1]["attempt"] == 1
        assert history[-1]["eventType"] == LC + "created"
        stats = (await client.get(f"/events/webhooks/{hook['id']}/stats")).json()
        assert stats["delivered"] == 4 and stats["failed"] == 5 and stats["backlog"] == 0
        assert stats["lastError"] == "the receiver answered HTTP 503"
        assert await metric(client, "aenv_webhook_deliveries_total", outcome="failed") == 5
        assert await metric(client, "aenv_webhook_deliveries_total", outcome="delivered") == 4
        assert await metric(client, "aenv_webhook_backlog") == 0


async def test_the_backlog_is_bounded_oldest_dropped_and_counted(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}/hook"  # the receiver is down: nothing listens
    async for h in started(tmp_path, api_key=API_KEY, webhook_backlog=3, **FAST):
        async with api_client(h) as c:
            with receiving() as rcv:
                hook = await register(c, rcv, url=dead)
                ids = [
                    (await h.orch.sandboxes.create(CreateRequest())).sandbox_id for _ in range(5)
                ]
                stats = (await c.get(f"/events/webhooks/{hook['id']}/stats")).json()
                assert stats["dropped"] == 2 and stats["backlog"] == 3
                assert await metric(c, "aenv_webhook_deliveries_total", outcome="dropped") == 2
                assert await metric(c, "aenv_webhook_backlog") == 3
                hist = (await c.get(f"/events/webhooks/{hook['id']}/deliveries?limit=100")).json()
                dropped = [d["sandboxId"] for d in hist if d["outcome"] == "dropped"]
                assert sorted(dropped) == sorted(ids[:2])
                # Back up: the three kept arrive (three sandboxes: at once, in any order).
                await c.patch(f"/events/webhooks/{hook['id']}", json={"url": rcv.url})
                await wait_for(rcv, 3)
                await asyncio.sleep(0.3)
                assert sorted(e["sandboxId"] for e in rcv.events()) == sorted(ids[2:])


async def test_a_restart_loses_no_pending_delivery(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}/hook"  # nothing listens: connection refused
    h = build(tmp_path, api_key=API_KEY, **FAST)
    await h.orch.start(timers=False)
    async with api_client(h) as c:
        hook = (await c.post("/events/webhooks", json={"name": "n", "url": dead})).json()
    sid = await life(h)
    await h.orch.close()
    with receiving() as rcv:
        h2 = await h.restart(api_key=API_KEY, **FAST)
        await h2.orch.start(timers=False)
        try:
            rcv.secret = hook["signatureSecret"]
            async with api_client(h2) as c:
                await c.patch(f"/events/webhooks/{hook['id']}", json={"url": rcv.url})
            got = await wait_for(rcv, 4)
            assert [(e["sandboxId"], e["type"]) for e in got] == [
                (sid, LC + t) for t in ("created", "paused", "resumed", "killed")
            ]
            assert all(r.signed for r in rcv.accepted)
        finally:
            await h2.orch.close()
            h2.catalog.close()


async def test_a_slow_receiver_never_slows_a_sandbox(
    node: Harness, client: httpx.AsyncClient
) -> None:
    with receiving(Receiver(delay=1.0)) as rcv:
        await register(client, rcv)
        started_at = time.monotonic()
        for _ in range(3):
            await life(node)
        assert time.monotonic() - started_at < 0.8
        await wait_for(rcv, 12)
