"""Reading sandboxes through the API over a real orchestrator on the fake runtime: a
sandbox's detail in E2B's shape, v1 and v2 listings with their filters, paging with
`nextToken`, and what the API hides (sandboxes being killed)."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import pytest

from aenv.api.listing import Cursor, paginate, parse_metadata_filter
from aenv.domain import CreateRequest, SandboxRecord
from aenv.domain import SandboxState as State
from aenv.errors import BadRequest
from aenv.runtime.fake import Call
from tests.node_harness import Harness
from tests.unit.api_node import assert_error, paused, running


async def test_get_detail_shape(client: httpx.AsyncClient, node: Harness) -> None:
    rec = await running(node, metadata={"a": "b"}, auto_pause=True, auto_resume=True)
    r = await client.get(f"/sandboxes/{rec.sandbox_id}")
    assert r.status_code == 200
    body = r.json()
    assert body == {
        "templateID": "base",
        "sandboxID": rec.sandbox_id,
        "clientID": "aenv",
        "alias": "base",
        "startedAt": body["startedAt"],
        "endAt": body["endAt"],
        "cpuCount": 2,
        "memoryMB": 512,
        "diskSizeMB": rec.disk_mb,
        "state": "running",
        "envdVersion": "0.6.4",
        "metadata": {"a": "b"},
        "envdAccessToken": rec.envd_access_token,
        "allowInternetAccess": True,
        "network": {
            "allowPublicTraffic": True,
            "allowOut": [],
            "denyOut": [],
        },
        "domain": None,
        "lifecycle": {"autoResume": True, "onTimeout": "pause"},
        # aenv's, next to E2B's (docs/fork-tree.md); the SDKs ignore it.
        "lineage": {"templateID": "base"},
    }
    assert datetime.fromisoformat(body["startedAt"]) == node.clock.now
    assert datetime.fromisoformat(body["endAt"]) == node.clock.now + timedelta(
        seconds=node.settings.default_timeout
    )

    rec2 = await paused(node)
    body = (await client.get(f"/sandboxes/{rec2.sandbox_id}")).json()
    assert body["state"] == "paused"
    assert body["lifecycle"] == {"autoResume": False, "onTimeout": "kill"}


async def test_naive_timestamps_get_a_timezone(client: httpx.AsyncClient, node: Harness) -> None:
    node.clock.now = datetime(2025, 1, 1, 12, 0, 0)  # a clock without a timezone
    rec = await node.orch.sandboxes.create(CreateRequest())
    assert rec.started_at.tzinfo is None
    body = (await client.get(f"/sandboxes/{rec.sandbox_id}")).json()
    assert datetime.fromisoformat(body["startedAt"]).utcoffset() == timedelta(0)
    assert datetime.fromisoformat(body["endAt"]).utcoffset() == timedelta(0)


async def test_a_sandbox_being_killed_is_invisible(
    client: httpx.AsyncClient, node: Harness
) -> None:
    rec = await running(node)
    # The kill holds in the runtime's destroy: the record is KILLING meanwhile.
    destroying, release = asyncio.Event(), asyncio.Event()

    async def hold(_call: Call) -> None:
        destroying.set()
        await release.wait()

    node.runtime.before("destroy", hold)
    kill = asyncio.create_task(client.delete(f"/sandboxes/{rec.sandbox_id}"))
    await asyncio.wait_for(destroying.wait(), 10)
    assert rec.state is State.KILLING
    assert_error(await client.get(f"/sandboxes/{rec.sandbox_id}"), 404)
    assert_error(await client.post(f"/sandboxes/{rec.sandbox_id}/resume"), 404)
    assert (await client.get("/v2/sandboxes")).json() == []
    release.set()
    assert (await kill).status_code == 204
    assert rec.state is State.KILLED
    assert_error(await client.get(f"/sandboxes/{rec.sandbox_id}"), 404)
    assert_error(await client.post(f"/sandboxes/{rec.sandbox_id}/resume"), 404)


async def test_list_v1(client: httpx.AsyncClient, node: Harness) -> None:
    a = await running(node, metadata={"team": "alpha"})
    b = await running(node, metadata={"team": "beta"})
    await paused(node, metadata={"team": "alpha"})
    r = await client.get("/sandboxes")
    assert r.status_code == 200
    assert [s["sandboxID"] for s in r.json()] == [a.sandbox_id, b.sandbox_id]  # running only
    assert "x-next-token" not in r.headers
    item = r.json()[0]
    assert set(item) == {
        "templateID",
        "sandboxID",
        "clientID",
        "alias",
        "startedAt",
        "endAt",
        "cpuCount",
        "memoryMB",
        "diskSizeMB",
        "state",
        "envdVersion",
        "metadata",
    }
    # AgentENV 04: GET /sandboxes?metadata=team%3Dalpha
    r = await client.get("/sandboxes?metadata=team%3Dalpha")
    assert [s["sandboxID"] for s in r.json()] == [a.sandbox_id]


async def test_list_v2_filters(client: httpx.AsyncClient, node: Harness) -> None:
    # A second template, named `py`, over the base's layers.
    base = node.catalog.template("base")
    assert base is not None
    node.catalog.put_template(dataclasses.replace(base, template_id="tpl2", names=["py"]))
    a = await running(node, metadata={"team": "alpha", "x": "a b&c=d"})
    b = await paused(node, metadata={"team": "alpha"}, template_id="py")
    c = await running(node, metadata={"team": "beta"})
    assert (b.template_id, b.alias) == ("tpl2", "py")

    async def ids(**params: Any) -> list[str]:
        r = await client.get("/v2/sandboxes", params=params)
        assert r.status_code == 200, r.text
        return [s["sandboxID"] for s in r.json()]

    assert await ids() == [c.sandbox_id, b.sandbox_id, a.sandbox_id]  # newest first
    assert await ids(order="asc") == [a.sandbox_id, b.sandbox_id, c.sandbox_id]
    assert await ids(state="running") == [c.sandbox_id, a.sandbox_id]
    assert await ids(state="paused") == [b.sandbox_id]
    assert await ids(state="running,paused", order="asc") == [
        a.sandbox_id,
        b.sandbox_id,
        c.sandbox_id,
    ]
    assert await ids(template="py") == [b.sandbox_id]
    assert await ids(template="tpl2") == [b.sandbox_id]
    assert await ids(metadata="team=alpha", order="asc") == [a.sandbox_id, b.sandbox_id]
    # The SDK's encoding: urlencode({quote(k): quote(v)}).
    sdk = urlencode({quote(k): quote(v) for k, v in {"team": "alpha", "x": "a b&c=d"}.items()})
    assert await ids(metadata=sdk) == [a.sandbox_id]
    assert await ids(startedAfter=b.started_at.isoformat(), order="asc") == [
        b.sandbox_id,
        c.sandbox_id,
    ]
    later = (b.started_at + timedelta(microseconds=1)).isoformat()
    assert await ids(startedAfter=later) == [c.sandbox_id]
    r = await client.get("/v2/sandboxes", params={"state": "paused"})
    assert r.json()[0]["state"] == "paused"


@pytest.mark.parametrize(
    "params",
    [
        {"state": "dead"},
        {"order": "sideways"},
        {"limit": "0"},
        {"limit": "1001"},
        {"limit": "x"},
        {"nextToken": "not-a-token!"},
        {"nextToken": "bm9wZQ"},  # base64 of "nope"
        {"metadata": "novalue"},
        {"startedAfter": "yesterday"},
    ],
)
async def test_list_v2_bad_query_is_400(client: httpx.AsyncClient, params: dict[str, str]) -> None:
    assert_error(await client.get("/v2/sandboxes", params=params), 400)


async def test_pagination_limit_1(client: httpx.AsyncClient, node: Harness) -> None:
    group = [await running(node, metadata={"suite": "g1"}) for _ in range(3)]
    await running(node, metadata={"suite": "other"})
    # Two sandboxes with the same start time (the clock not moved): the id breaks the tie.
    node.clock.advance(1)
    group += [
        await node.orch.sandboxes.create(CreateRequest(metadata={"suite": "g1"})) for _ in range(2)
    ]
    assert group[-1].started_at == group[-2].started_at
    for order in ("desc", "asc"):
        seen: list[str] = []
        params: dict[str, Any] = {"metadata": "suite=g1", "limit": 1, "order": order}
        for _ in range(10):
            r = await client.get("/v2/sandboxes", params=params)
            assert r.status_code == 200
            assert len(r.json()) == 1
            seen += [s["sandboxID"] for s in r.json()]
            token = r.headers.get("x-next-token")
            if not token:
                break
            params["nextToken"] = token
        assert sorted(seen) == sorted(g.sandbox_id for g in group)
        assert len(seen) == len(set(seen))
        if order == "asc":
            assert seen == [
                g.sandbox_id for g in sorted(group, key=lambda g: (g.started_at, g.sandbox_id))
            ]


async def test_pagination_last_page_has_no_token(client: httpx.AsyncClient, node: Harness) -> None:
    for _ in range(4):
        await running(node)
    r = await client.get("/v2/sandboxes", params={"limit": 2})
    assert len(r.json()) == 2 and r.headers["x-next-token"]
    r = await client.get(
        "/v2/sandboxes", params={"limit": 2, "nextToken": r.headers["x-next-token"]}
    )
    assert len(r.json()) == 2
    assert "x-next-token" not in r.headers  # exactly full last page: no empty trailing page
    r = await client.get("/v2/sandboxes", params={"limit": 100})
    assert len(r.json()) == 4 and "x-next-token" not in r.headers


def _record(n: int) -> SandboxRecord:
    started = datetime(2025, 1, 1, tzinfo=UTC) + timedelta(seconds=n)
    return SandboxRecord(
        sandbox_id=f"sbx{n:04d}",
        template_id="base",
        alias="base",
        client_id="aenv",
        started_at=started,
        end_at=started + timedelta(seconds=300),
        cpu_count=2,
        memory_mb=512,
        disk_mb=1024,
        state=State.RUNNING,
        envd_version="0.6.4",
        envd_access_token=f"tok-{n}",
    )


def test_paginate_survives_deletion_between_pages() -> None:
    recs = [_record(n) for n in range(5)]
    page, token = paginate(recs, order="asc", limit=2, cursor=None)
    assert [r.sandbox_id for r in page] == [recs[0].sandbox_id, recs[1].sandbox_id]
    assert token
    rest = [r for r in recs if r is not recs[2]]  # the next one was deleted meanwhile
    page, token = paginate(rest, order="asc", limit=2, cursor=Cursor.decode(token))
    assert [r.sandbox_id for r in page] == [recs[3].sandbox_id, recs[4].sandbox_id]
    assert token is None


def test_parse_metadata_filter() -> None:
    assert parse_metadata_filter(None) is None
    assert parse_metadata_filter("") is None
    assert parse_metadata_filter("team=alpha&x=y") == {"team": "alpha", "x": "y"}
    assert parse_metadata_filter("k%2520=v%2526") == {"k ": "v&"}
    assert parse_metadata_filter("k=") == {"k": ""}
    for bad in ("novalue", "=v"):
        with pytest.raises(BadRequest):
            parse_metadata_filter(bad)
