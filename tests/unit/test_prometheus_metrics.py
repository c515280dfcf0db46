"""What Prometheus scrapes from a node and from a gateway: HTTP requests by route template
(never by a path with ids), the process and the build, the gateway's own registry
(placements, routing errors, forwards, the nodes it sees) behind the API key, request ids
through the gateway to the node, and the keyless listener of `AENV_METRICS_LISTEN`."""

from __future__ import annotations

import contextlib
import platform
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from aenv import __version__
from aenv.cluster.metrics import ROUTE_TEMPLATES, route_template
from aenv.cluster.state import ClusterState
from aenv.config import Settings
from aenv.domain import CreateRequest
from aenv.errors import AenvError
from aenv.server import gateway_app, node_app
from aenv.telemetry import MetricsListener
from tests.helpers import RedisServer, free_port, redis_server, uvicorn_task
from tests.node_harness import Harness, started
from tests.unit.test_cluster_gateway import FakeNode

KEY = "e2b_metrics_test_key_0123"


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sample(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, frozenset(labels.items())), 0.0)


def names(text: str) -> set[str]:
    return {name for name, _ in samples(text)}


async def assert_closed(port: int) -> None:
    """Closing the listener closed its port."""
    async with httpx.AsyncClient() as c:
        with pytest.raises(httpx.ConnectError):
            await c.get(f"http://127.0.0.1:{port}/metrics")


# ---------------------------------------------------------------------------- a node
@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    async for h in started(tmp_path, api_key=KEY):
        yield h


@contextlib.asynccontextmanager
async def node_client(h: Harness, **headers: str) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=node_app(h.settings, h.orch))
    async with httpx.AsyncClient(
        transport=transport, base_url="http://aenv", headers={"X-API-Key": KEY, **headers}
    ) as c:
        yield c


async def test_a_nodes_requests_are_counted_by_route_template(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    async with node_client(node) as api:
        assert (await api.get(f"/sandboxes/{r.sandbox_id}")).status_code == 200
        assert (await api.get("/sandboxes/no-such-one")).status_code == 404
        assert (await api.get("/no/such/route/a1b2")).status_code == 404
        # The data plane: a sandbox's port, by its header.
        await api.get("/", headers={"E2b-Sandbox-Id": r.sandbox_id, "E2b-Sandbox-Port": "49983"})
        text = (await api.get("/metrics")).text
    by_id = {"method": "GET", "route": "/sandboxes/{sandbox_id}"}
    assert sample(text, "aenv_http_requests_total", **by_id, status="200") == 1
    assert sample(text, "aenv_http_requests_total", **by_id, status="404") == 1
    assert sample(text, "aenv_http_request_duration_seconds_count", **by_id) == 2
    assert sample(text, "aenv_http_requests_total", method="GET", route="unmatched", status="404")
    data_plane = [k for k in samples(text) if ("route", "data-plane") in k[1]]
    assert data_plane, "the data plane's request was not counted"
    # Bounded: no path with an id (or a scanner's path) became a label.
    assert r.sandbox_id not in text and "a1b2" not in text


async def test_a_node_exports_its_process_and_build(node: Harness) -> None:
    async with node_client(node) as api:
        text = (await api.get("/metrics")).text
    assert sample(text, "aenv_build_info", version=__version__, python=_python()) == 1
    assert sample(text, "process_resident_memory_bytes") > 0
    assert "process_cpu_seconds_total" in names(text)
    # Beside the node's own families, in one registry.
    assert "aenv_sandboxes" in names(text)


def _python() -> str:
    return platform.python_version()


async def test_the_metrics_listener_serves_metrics_without_a_key(node: Harness) -> None:
    port = free_port()
    listener = MetricsListener(f"127.0.0.1:{port}", node.orch.stats.exposition)
    await listener.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
            got = await c.get("/metrics")
            assert got.status_code == 200, got.text
            assert got.headers["content-type"].startswith("text/plain")
            assert sample(got.text, "aenv_build_info", version=__version__, python=_python())
            # Only /metrics: nothing of the API is reachable without the key here.
            assert (await c.get("/sandboxes")).status_code == 404
            assert (await c.post("/metrics")).status_code == 405
    finally:
        await listener.close()
    await assert_closed(port)


async def test_a_metrics_listener_on_a_taken_port_fails_clearly(node: Harness) -> None:
    port = free_port()
    first = MetricsListener(f"127.0.0.1:{port}", node.orch.stats.exposition)
    await first.start()
    try:
        with pytest.raises(AenvError, match=f"AENV_METRICS_LISTEN=127.0.0.1:{port}"):
            await MetricsListener(f"127.0.0.1:{port}", node.orch.stats.exposition).start()
    finally:
        await first.close()


def test_metrics_listen_setting(tmp_path: Path) -> None:
    assert Settings(home=tmp_path).metrics_listen is None
    assert Settings(home=tmp_path, metrics_listen="").metrics_listen is None
    assert Settings(home=tmp_path, metrics_listen="0.0.0.0:9464").metrics_listen == "0.0.0.0:9464"
    with pytest.raises(ValidationError, match="host:port"):
        Settings(home=tmp_path, metrics_listen="9464x")


def test_the_gateway_knows_every_route_of_the_node(node: Harness) -> None:
    """The gateway reports requests under the node API's templates: a route added to the
    node and not to `ROUTE_TEMPLATES` would be `unmatched` on gateways."""
    app: Any = node_app(node.settings, node.orch)
    while not hasattr(app, "openapi"):  # through the middleware and the data-plane router
        app = getattr(app, "app", None) or app.control_app
    node_routes = set(app.openapi()["paths"])
    assert "/sandboxes/{sandbox_id}/pause" in node_routes
    for fmt in node_routes:
        assert route_template(fmt.replace("{", "x").replace("}", "x")) == fmt, fmt
    assert len(ROUTE_TEMPLATES) == len(set(ROUTE_TEMPLATES))


# ---------------------------------------------------------------------------- a gateway
@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as srv:
        yield srv


@contextlib.asynccontextmanager
async def gateway(
    srv: RedisServer, home: Path, **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeNode, FakeNode]]:
    a, b = FakeNode("na"), FakeNode("nb")
    state = ClusterState(srv.url)
    try:
        async with uvicorn_task(a.app()) as pa, uvicorn_task(b.app()) as pb:
            await state.heartbeat(a.record(pa), {}, None)
            await state.heartbeat(b.record(pb), {}, None)
            s = Settings(home=home, redis_url=srv.url, api_key=KEY, **settings)
            async with (
                uvicorn_task(gateway_app(s), lifespan="on") as pg,
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{pg}") as client,
            ):
                yield client, a, b
    finally:
        await state.close()


async def test_a_gateway_serves_its_own_metrics(redis: RedisServer, tmp_path: Path) -> None:
    async with gateway(redis, tmp_path) as (client, a, b):
        made = await client.post("/v2/sandboxes", json={"templateID": "base"})
        assert made.status_code == 201, made.text
        sid = made.json()["sandboxID"]
        assert (await client.get(f"/sandboxes/{sid}")).status_code == 200
        assert (await client.get("/sandboxes/nowhere")).status_code == 404
        assert (await client.get("/metrics")).status_code == 401
        wrong = await client.get("/metrics", headers={"X-API-Key": "e2b_wrong"})
        assert wrong.status_code == 401
        got = await client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert got.status_code == 200, got.text
    text = got.text
    # The gateway's, not a node's: the fake nodes have no /metrics at all.
    assert not [s for s in a.seen + b.seen if "metrics" in s]
    assert sample(text, "aenv_gateway_placements_total", kind="sandbox", outcome="placed") == 1
    assert sample(text, "aenv_gateway_routing_errors_total", reason="not_found") == 1
    assert sample(text, "aenv_gateway_nodes", status="ready") == 2
    assert sample(text, "aenv_gateway_nodes", status="unhealthy") == 0
    assert ("aenv_gateway_node_heartbeat_age_seconds", frozenset({("node", "na")})) in samples(text)
    assert sample(text, "aenv_gateway_cluster_state_up") == 1
    assert sample(text, "aenv_gateway_forward_duration_seconds_count", mode="buffered") >= 1
    assert sample(text, "aenv_gateway_forward_duration_seconds_count", mode="streamed") >= 1
    route = {"method": "GET", "route": "/sandboxes/{sandbox_id}"}
    assert sample(text, "aenv_http_requests_total", **route, status="200") == 1
    assert sample(text, "aenv_http_requests_total", **route, status="404") == 1
    assert sample(
        text, "aenv_http_requests_total", method="POST", route="/v2/sandboxes", status="201"
    )
    assert sid not in text
    assert sample(text, "aenv_build_info", version=__version__, python=_python()) == 1
    assert sample(text, "process_resident_memory_bytes") > 0


async def test_placements_that_find_no_room_are_counted(redis: RedisServer, tmp_path: Path) -> None:
    async with gateway(redis, tmp_path) as (client, a, b):
        a.full = b.full = True
        assert (await client.post("/v2/sandboxes", json={"templateID": "base"})).status_code == 503
        bad = await client.post("/v2/sandboxes", json={"templateID": "missing!"})
        assert bad.status_code == 400
        text = (await client.get("/metrics", headers={"X-API-Key": KEY})).text
    assert sample(text, "aenv_gateway_placements_total", kind="sandbox", outcome="turned_down") == 1
    assert sample(text, "aenv_gateway_placements_total", kind="sandbox", outcome="failed") == 1


async def test_a_gateways_request_id_is_answered_and_goes_on_to_the_node(
    redis: RedisServer, tmp_path: Path
) -> None:
    async with gateway(redis, tmp_path) as (client, a, b):
        mine = await client.post(
            "/v2/sandboxes", json={"templateID": "base"}, headers={"X-Request-Id": "trace-42"}
        )
        assert mine.headers["x-request-id"] == "trace-42"
        # Passed through (streamed) rather than read: the id goes along all the same.
        fresh = await client.get(f"/sandboxes/{mine.json()['sandboxID']}")
        rid = fresh.headers["x-request-id"]
        assert len(rid) == 16 and rid != "trace-42"
    ids = a.request_ids + b.request_ids
    assert "trace-42" in ids and rid in ids


async def test_a_gateways_metrics_listener(redis: RedisServer, tmp_path: Path) -> None:
    port = free_port()
    async with gateway(redis, tmp_path, metrics_listen=f"127.0.0.1:{port}") as (client, _, _):
        await client.get("/health")
        async with httpx.AsyncClient() as plain:
            got = await plain.get(f"http://127.0.0.1:{port}/metrics")
        assert got.status_code == 200
        assert sample(got.text, "aenv_gateway_nodes", status="ready") == 2
        assert sample(
            got.text, "aenv_http_requests_total", method="GET", route="/health", status="200"
        )
    await assert_closed(port)
