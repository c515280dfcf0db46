"""The gateway's routing, over a real redis-server and two node-like servers on loopback: a
create goes to a node that takes it (another is tried when one is full, a client's mistake
is answered at once), the sandbox's later requests follow its binding, a fork's children
are bound where their parent is, a kill unbinds it, and a signed file URL made against the
gateway's address reaches the sandbox that signed it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.cluster.directory import Directory
from aenv.cluster.forward import NodeClient
from aenv.cluster.gwevents import GatewayEvents
from aenv.cluster.lostsweep import LostSweep
from aenv.cluster.metrics import GatewayMetrics
from aenv.cluster.records import NodeRecord, RosterEntry
from aenv.cluster.scheduler import load_scheduler
from aenv.cluster.state import ClusterState
from aenv.config import Settings
from aenv.server import gateway_app
from tests.helpers import RedisServer, redis_server, uvicorn_task


class FakeNode:
    """A node's API as far as the gateway reads it; `full` answers creates 503."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.full = False
        self.sandboxes: set[str] = set()
        # Templates this node's catalog knows, and whether each is public.
        self.templates: dict[str, bool] = {}
        self.seen: list[str] = []
        # Lifecycle events a gateway asked this node to record (`POST /cluster/events`).
        self.events: list[dict[str, object]] = []
        # The X-Request-Id of each request the node got (the gateway passes its own on).
        self.request_ids: list[str] = []
        self._ids = itertools.count(1)

    def app(self) -> Starlette:
        async def create(request: Request) -> Response:
            self.seen.append(f"{request.method} {request.url.path}")
            self.request_ids.append(request.headers.get("x-request-id", ""))
            body = await request.json()
            if body.get("templateID") == "missing!":
                return JSONResponse({"code": 400, "message": "bad template"}, 400)
            if self.full:
                return JSONResponse({"code": 503, "message": "the node is full"}, 503)
            sid = f"{self.node_id}x{next(self._ids)}"
            self.sandboxes.add(sid)
            return JSONResponse({"sandboxID": sid, "templateID": body["templateID"]}, 201)

        async def sandbox(request: Request) -> Response:
            sid = request.path_params["sid"]
            self.seen.append(f"{request.method} {request.url.path}")
            self.request_ids.append(request.headers.get("x-request-id", ""))
            if sid not in self.sandboxes:
                return JSONResponse({"code": 404, "message": "not here"}, 404)
            if request.method == "DELETE":
                self.sandboxes.discard(sid)
                return Response(status_code=204)
            return JSONResponse({"sandboxID": sid, "node": self.node_id})

        async def fork(request: Request) -> Response:
            sid = request.path_params["sid"]
            self.seen.append(f"{request.method} {request.url.path}")
            children = [f"{sid}c{i}" for i in range(2)]
            self.sandboxes.update(children)
            return JSONResponse([{"sandbox": {"sandboxID": c}} for c in children], 201)

        async def signed(request: Request) -> Response:
            # A sandbox's "token" signs `sig-{its id}` here.
            body = await request.json()
            sid = str(body["signature"]).removeprefix("sig-")
            if sid not in self.sandboxes or body["operation"] != "read":
                return JSONResponse({"code": 404, "message": "not signed here"}, 404)
            return JSONResponse({"sandboxID": sid})

        async def files(request: Request) -> Response:
            # The data plane as the node's router gets it from a gateway.
            self.seen.append(f"{request.method} {request.url.path}")
            return JSONResponse(
                {"node": self.node_id, "sandbox": request.headers.get("e2b-sandbox-id")}
            )

        async def listing(request: Request) -> Response:
            items = [
                {"sandboxID": sid, "startedAt": "2026-01-01T00:00:00Z"}
                for sid in sorted(self.sandboxes)
            ]
            return JSONResponse(items, headers={"X-Total-Running": str(len(items))})

        async def bulk(request: Request) -> Response:
            # Every sandbox here "matches"; a node refuses an empty query.
            self.seen.append(f"{request.method} {request.url.path}")
            if not request.query_params.get("metadata"):
                return JSONResponse({"code": 400, "message": "metadata required"}, 400)
            done = sorted(self.sandboxes)
            if request.method == "DELETE":
                self.sandboxes.clear()
            return JSONResponse({"sandboxIDs": done, "failed": []})

        async def template(request: Request) -> Response:
            tid = request.path_params["tid"]
            self.seen.append(f"{request.method} {request.url.path}")
            if tid not in self.templates:
                return JSONResponse({"code": 404, "message": "no such template"}, 404)
            if request.method == "PATCH":
                self.templates[tid] = bool((await request.json())["public"])
                return Response(status_code=200)
            if request.method == "DELETE":
                del self.templates[tid]
                return Response(status_code=204)
            return JSONResponse({"templateID": tid, "public": self.templates[tid]})

        async def record_event(request: Request) -> Response:
            self.events.append(await request.json())
            return Response(status_code=202)

        return Starlette(
            routes=[
                Route("/cluster/events", record_event, methods=["POST"]),
                Route("/templates/{tid}", template, methods=["GET", "PATCH", "DELETE"]),
                Route("/v2/templates/{tid}", template, methods=["PATCH"]),
                Route("/sandboxes", bulk, methods=["DELETE"]),
                Route("/sandboxes/pause", bulk, methods=["POST"]),
                Route("/sandboxes/timeout", bulk, methods=["POST"]),
                Route("/v2/sandboxes", listing, methods=["GET"]),
                Route("/cluster/signed", signed, methods=["POST"]),
                Route("/files", files, methods=["GET", "POST"]),
                Route("/v2/sandboxes", create, methods=["POST"]),
                Route("/sandboxes/{sid}", sandbox, methods=["GET", "DELETE"]),
                Route("/sandboxes/{sid}/fork", fork, methods=["POST"]),
            ]
        )

    def record(self, port: int) -> NodeRecord:
        return NodeRecord(
            node_id=self.node_id,
            url=f"http://127.0.0.1:{port}",
            cpu_count=8,
            memory_total_mb=8192,
            memory_budget_mb=8192,
        )


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as srv:
        yield srv


@contextlib.asynccontextmanager
async def cluster(
    srv: RedisServer, home: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeNode, FakeNode, ClusterState]]:
    a, b = FakeNode("na"), FakeNode("nb")
    state = ClusterState(srv.url)
    try:
        async with uvicorn_task(a.app()) as pa, uvicorn_task(b.app()) as pb:
            await state.heartbeat(a.record(pa), {}, None)
            await state.heartbeat(b.record(pb), {}, None)
            settings = Settings(home=home, redis_url=srv.url)
            async with (
                uvicorn_task(gateway_app(settings), lifespan="on") as pg,
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{pg}") as client,
            ):
                yield client, a, b, state
    finally:
        await state.close()


def owner(a: FakeNode, b: FakeNode, sandbox_id: str) -> FakeNode:
    return a if sandbox_id in a.sandboxes else b


async def test_a_sandbox_is_created_on_a_node_and_followed_there(
    redis: RedisServer, tmp_path: Path
) -> None:
    async with cluster(redis, tmp_path) as (client, a, b, state):
        r = await client.post("/v2/sandboxes", json={"templateID": "base"})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        node = owner(a, b, sid)
        assert await state.binding(sid) == node.node_id
        got = await client.get(f"/sandboxes/{sid}")
        assert got.json() == {"sandboxID": sid, "node": node.node_id}
        other = b if node is a else a
        assert not [s for s in other.seen if sid in s]


async def test_a_full_node_passes_the_create_to_another(redis: RedisServer, tmp_path: Path) -> None:
    async with cluster(redis, tmp_path) as (client, a, b, _):
        a.full = True
        for _ in range(3):
            r = await client.post("/v2/sandboxes", json={"templateID": "base"})
            assert r.status_code == 201, r.text
            assert r.json()["sandboxID"] in b.sandboxes
        b.full = True
        r = await client.post("/v2/sandboxes", json={"templateID": "base"})
        assert r.status_code == 503 and r.json()["message"] == "the node is full"


async def test_a_clients_mistake_is_answered_by_the_first_node(
    redis: RedisServer, tmp_path: Path
) -> None:
    async with cluster(redis, tmp_path) as (client, a, b, _):
        r = await client.post("/v2/sandboxes", json={"templateID": "missing!"})
        assert r.status_code == 400 and r.json()["message"] == "bad template"
        # Not retried elsewhere: one node saw it.
        assert len(a.seen) + len(b.seen) == 1


async def test_fork_children_are_bound_with_their_parent_and_a_kill_unbinds(
    redis: RedisServer, tmp_path: Path
) -> None:
    async with cluster(redis, tmp_path) as (client, a, b, state):
        sid = (await client.post("/v2/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
        node = owner(a, b, sid)
        forked = await client.post(f"/sandboxes/{sid}/fork", json={"count": 2})
        assert forked.status_code == 201
        children = [item["sandbox"]["sandboxID"] for item in forked.json()]
        assert [await state.binding(c) for c in children] == [node.node_id] * 2
        for c in children:
            assert (await client.get(f"/sandboxes/{c}")).json()["node"] == node.node_id
        assert (await client.delete(f"/sandboxes/{sid}")).status_code == 204
        assert await state.binding(sid) is None
        gone = await client.get(f"/sandboxes/{sid}")
        assert gone.status_code == 404


async def test_a_signed_file_url_reaches_the_sandbox_that_signed_it(
    redis: RedisServer, tmp_path: Path
) -> None:
    """The SDK's `download_url` against the gateway names no sandbox: the gateway asks the
    nodes which sandbox signed it and routes there; a signature nobody made is a 401."""
    async with cluster(redis, tmp_path) as (client, a, b, _):
        made = [
            (await client.post("/v2/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
            for _ in range(4)
        ]
        for sid in made:
            node = owner(a, b, sid)
            r = await client.get("/files", params={"path": "/x", "signature": f"sig-{sid}"})
            assert r.status_code == 200, r.text
            assert r.json() == {"node": node.node_id, "sandbox": sid}
        r = await client.get("/files", params={"path": "/x", "signature": "sig-nobody"})
        assert r.status_code == 401 and r.json()["message"] == "invalid signature"
        # Without a signature it is no data-plane request: passed to a node as it came.
        r = await client.get("/files", params={"path": "/x"})
        assert r.json()["sandbox"] is None


async def test_the_running_count_of_a_listing_is_every_nodes(
    redis: RedisServer, tmp_path: Path
) -> None:
    async with cluster(redis, tmp_path) as (client, a, b, _):
        for _ in range(5):
            assert (await client.post("/v2/sandboxes", json={"templateID": "base"})).is_success
        r = await client.get("/v2/sandboxes", params={"limit": 2})
        assert len(r.json()) == 2 and r.headers["X-Total-Running"] == "5"
        assert len(a.sandboxes) + len(b.sandboxes) == 5


async def test_a_bulk_operation_runs_on_every_node_and_a_kill_unbinds(
    redis: RedisServer, tmp_path: Path
) -> None:
    async with cluster(redis, tmp_path) as (client, a, b, state):
        made = []
        for _ in range(4):
            made.append((await client.post("/v2/sandboxes", json={"templateID": "base"})).json())
        ids = sorted(m["sandboxID"] for m in made)
        assert a.sandboxes and b.sandboxes  # spread over both
        q = {"metadata": "run=r1"}
        r = await client.post("/sandboxes/timeout", params=q, json={"timeout": 60})
        assert r.status_code == 200 and sorted(r.json()["sandboxIDs"]) == ids
        assert "POST /sandboxes/timeout" in a.seen and "POST /sandboxes/timeout" in b.seen
        r = await client.post("/sandboxes/pause", params=q)
        assert sorted(r.json()["sandboxIDs"]) == ids
        assert (await client.delete("/sandboxes")).status_code == 400  # no query: nothing
        assert len(a.sandboxes) + len(b.sandboxes) == 4
        r = await client.delete("/sandboxes", params=q)
        assert r.status_code == 200 and sorted(r.json()["sandboxIDs"]) == ids
        assert r.json()["failed"] == [] and "unreachableNodes" not in r.json()
        for sid in ids:
            assert await state.binding(sid) is None


async def test_a_fork_of_a_snapshot_goes_where_the_snapshot_is(
    redis: RedisServer, tmp_path: Path
) -> None:
    async with cluster(redis, tmp_path) as (client, a, b, state):
        await state.bind_template("snap1", b.node_id)
        r = await client.post("/sandboxes/snap1/fork", json={"count": 2})
        assert r.status_code == 201, r.text
        assert "POST /sandboxes/snap1/fork" in b.seen and not a.seen
        for child in ("snap1c0", "snap1c1"):
            assert await state.binding(child) == b.node_id


async def test_a_template_change_reaches_every_node_that_knows_it(
    redis: RedisServer, tmp_path: Path
) -> None:
    """A template a node built is known to the others once they learned it from the
    repository: making it public (either PATCH route) or deleting it changes it on all of
    them; the node that built it answers."""
    async with cluster(redis, tmp_path) as (client, a, b, state):
        a.templates["tpl"] = b.templates["tpl"] = False
        await state.bind_template("tpl", a.node_id)
        r = await client.patch("/templates/tpl", json={"public": True})
        assert r.status_code == 200
        assert a.templates == b.templates == {"tpl": True}
        r = await client.patch("/v2/templates/tpl", json={"public": False})
        assert r.status_code == 200
        assert a.templates == b.templates == {"tpl": False}
        assert (await client.get("/templates/tpl")).json()["public"] is False
        assert (await client.delete("/templates/tpl")).status_code == 204
        assert a.templates == b.templates == {}
        # One the cluster does not know: the building node's 404, not a merged guess.
        assert (await client.patch("/templates/nope", json={"public": True})).status_code == 404


async def test_the_sandboxes_of_a_dead_node_are_recorded_lost_without_a_request(
    redis: RedisServer, tmp_path: Path
) -> None:
    """A node stops heartbeating: each of its sandboxes nobody can resume (not hibernated
    into the repository, still bound to it) is recorded killed with `node_lost` on a
    healthy node, once, by the gateway's own sweep."""
    a, b = FakeNode("na"), FakeNode("nb")
    state = ClusterState(redis.url)
    settings = Settings(home=tmp_path, redis_url=redis.url, node_dead_after=0.5)
    try:
        async with uvicorn_task(a.app()) as pa, uvicorn_task(b.app()) as pb:
            roster = {
                "gone1": RosterEntry(state="running", template_id="base"),
                "asleep": RosterEntry(state="paused", tier="hibernated", image="img-1"),
                "moved": RosterEntry(state="running"),
            }
            await state.heartbeat(b.record(pb), roster, None)
            await state.bind("moved", a.node_id)
            nodes = NodeClient(GatewayMetrics())
            directory = Directory(settings, state, load_scheduler(settings.scheduler), None)
            sweep = LostSweep(settings, state, GatewayEvents(state, directory, nodes))
            await state.heartbeat(a.record(pa), {}, None)
            assert await sweep.round() == 0  # nb is still alive
            await asyncio.sleep(1.0)
            await state.heartbeat(a.record(pa), {}, None)
            assert await sweep.round() == 1
            assert [(e["sandboxId"], e["type"]) for e in a.events] == [
                ("gone1", "sandbox.lifecycle.killed")
            ]
            assert a.events[0]["eventData"] == {"kill_reason": "node_lost", "node_id": "nb"}
            assert await sweep.round() == 0  # once
            assert len(a.events) == 1
            await nodes.aclose()
    finally:
        await state.close()
