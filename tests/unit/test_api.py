"""The control plane's API over a real orchestrator on the fake runtime: the two planes,
auth, errors in E2B's shape, the API document, the lifespan, and create (its JSON shapes,
what the node makes of the request, Server-Timing, idempotency, refused bodies).
Listing: test_api_listing.py; the calls on a sandbox: test_api_lifecycle.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import Message

from aenv.api.idempotency import IdempotencyCache
from aenv.domain import EgressPolicy, Timings
from aenv.domain import SandboxState as State
from aenv.errors import BadRequest
from aenv.runtime.fake import FakeState
from aenv.server import node_app
from tests.node_harness import Harness, build, started
from tests.unit.api_node import API_KEY, api_client, assert_error, assert_nothing_created, running

# --------------------------------------------------------------------------------------------
# health, auth, errors


async def test_health_needs_no_key(client: httpx.AsyncClient) -> None:
    r = await client.get("/health", headers={"X-API-Key": ""})
    assert r.status_code == 204
    assert r.content == b""
    r = await httpx.AsyncClient(transport=client._transport, base_url="http://test").get("/health")
    assert r.status_code == 204


async def test_sandbox_headers_go_to_the_data_plane(client: httpx.AsyncClient) -> None:
    # `/health` exists on both planes; the E2b-Sandbox-Id header decides: the proxy answers
    # for a sandbox it does not know with E2B's 502 naming it.
    r = await client.get("/health", headers={"E2b-Sandbox-Id": "nope", "E2b-Sandbox-Port": "49983"})
    assert assert_error(r, 502)["sandboxId"] == "nope"
    assert (await client.get("/health")).status_code == 204


ENVD_TOKEN = "<the envd token of a running sandbox>"


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [("X-API-Key", "wrong-key")],
        [("Authorization", "Bearer wrong-key")],
        [("Authorization", f"Basic {API_KEY}")],
        [("X-API-Key", API_KEY), ("Authorization", f"Bearer {API_KEY}")],
        [("Authorization", f"Bearer {API_KEY}"), ("Authorization", f"Bearer {API_KEY}")],
        [("X-Admin-Token", API_KEY)],
        [("X-Team-ID", API_KEY)],
        [("X-API-Key", API_KEY), ("X-API-Key", API_KEY)],
        [("X-API-Key", API_KEY), ("X-API-Key", "wrong")],
        [("X-API-Key", "wrong"), ("X-API-Key", API_KEY)],
        [("X-API-Key", "wrong"), ("X-API-Key", "wrong2")],
        [("X-API-Key", ENVD_TOKEN)],  # a sandbox's envd token is no API key
    ],
    ids=[
        "none",
        "wrong",
        "bearer-wrong",
        "basic",
        "both-headers",
        "dup-bearer",
        "admin-token",
        "team-id",
        "dup-valid",
        "dup-valid-invalid",
        "dup-invalid-valid",
        "dup-invalid",
        "envd-token",
    ],
)
async def test_auth_rejections(node: Harness, headers: list[tuple[str, str]]) -> None:
    sbx = await running(node)
    headers = [(k, sbx.envd_access_token if v == ENVD_TOKEN else v) for k, v in headers]
    async with api_client(node, key=None) as c:
        for path in ("/sandboxes", "/v2/sandboxes"):
            r = await c.get(path, headers=headers)
            assert_error(r, 401)
        r = await c.post("/v2/sandboxes", headers=headers, json={"templateID": "base"})
        assert_error(r, 401)
        r = await c.delete(f"/sandboxes/{sbx.sandbox_id}", headers=headers)
        assert_error(r, 401)
    assert node.orch.table.all() == [sbx] and sbx.state is State.RUNNING


async def test_auth_accepts_key_case_insensitive_header(client: httpx.AsyncClient) -> None:
    r = await client.get("/sandboxes", headers={"x-api-key": API_KEY})
    assert r.status_code == 200
    r = await client.get("/sandboxes", headers={"X-API-KEY": API_KEY})
    assert r.status_code == 200


async def test_unknown_route_is_json_404(client: httpx.AsyncClient) -> None:
    body = assert_error(await client.get("/nope"), 404)
    assert "/nope" in body["message"]
    # Also without credentials: unknown routes are not an auth question.
    r = await httpx.AsyncClient(transport=client._transport, base_url="http://test").get("/x")
    assert_error(r, 404)


async def test_wrong_method_is_json_405(client: httpx.AsyncClient) -> None:
    assert_error(await client.put("/health"), 405)


async def test_unknown_sandbox_is_json_404(client: httpx.AsyncClient) -> None:
    for method, path, body in [
        ("GET", "/sandboxes/nope", None),
        ("DELETE", "/sandboxes/nope", None),
        ("POST", "/sandboxes/nope/timeout", {"timeout": 10}),
        ("POST", "/sandboxes/nope/refreshes", {}),
        ("POST", "/sandboxes/nope/pause", {}),
        ("POST", "/sandboxes/nope/connect", {"timeout": 10}),
        ("POST", "/v2/sandboxes/nope/connect", {}),
        ("POST", "/sandboxes/nope/resume", {}),
    ]:
        r = await client.request(method, path, json=body)
        assert_error(r, 404)


async def test_template_not_found_is_404(client: httpx.AsyncClient, node: Harness) -> None:
    body = assert_error(await client.post("/v2/sandboxes", json={"templateID": "missing"}), 404)
    assert "'missing'" in body["message"]
    assert_nothing_created(node)


@pytest.mark.parametrize(
    "body, needle",
    [
        ({}, "templateID"),
        ({"templateID": "base", "timeout": -1}, "timeout"),
        ({"templateID": "base", "timeout": 10**9}, "timeout"),
        ({"templateID": "base", "cpuCount": 0}, "cpuCount"),
        ({"templateID": "base", "cpuCount": 17}, "cpuCount"),
        ({"templateID": "base", "memoryMB": 64}, "memoryMB"),
        ({"templateID": "base", "memoryMB": 65537}, "memoryMB"),
        ({"templateID": "base", "metadata": {"k": 1}}, "metadata"),
        ({"templateID": "base", "autoResume": {"enabled": "maybe"}}, "autoResume"),
    ],
)
async def test_create_validation_is_json_400(
    client: httpx.AsyncClient, node: Harness, body: dict[str, Any], needle: str
) -> None:
    for path in ("/sandboxes", "/v2/sandboxes"):
        err = assert_error(await client.post(path, json=body), 400)
        assert needle in err["message"]
    assert_nothing_created(node)


async def test_bad_json_is_json_400(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v2/sandboxes", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert "JSON" in assert_error(r, 400)["message"]


async def test_non_json_body_is_json_400(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v2/sandboxes",
        content=b'{"templateID":"base"}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert "Content-Type: application/json" in assert_error(r, 400)["message"]


async def test_unexpected_exception_is_json_500(client: httpx.AsyncClient, node: Harness) -> None:
    # The runtime failing in a way nothing in the node expects: its freeze raises a bare
    # RuntimeError, which nothing between the runtime and the API catches.
    sbx = await running(node)
    node.runtime.fail_next("freeze", RuntimeError("kaboom"))
    body = assert_error(await client.post(f"/sandboxes/{sbx.sandbox_id}/pause"), 500)
    assert body["message"] == "internal error: RuntimeError: kaboom"
    assert node.orch.table.get(sbx.sandbox_id).state is State.RUNNING


async def test_openapi_and_docs_are_public(client: httpx.AsyncClient) -> None:
    anon = httpx.AsyncClient(transport=client._transport, base_url="http://test")
    r = await anon.get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert doc["info"]["title"] == "aenv"
    assert "/v2/sandboxes" in doc["paths"]
    props = doc["components"]["schemas"]["Sandbox"]["properties"]
    assert {"sandboxID", "templateID", "trafficAccessToken", "domain"} <= set(props)
    # Validation errors are 400 here: the document must not promise 422.
    responses = doc["paths"]["/v2/sandboxes"]["post"]["responses"]
    assert "201" in responses and "400" in responses and "422" not in responses
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    assert (await anon.get("/docs")).status_code == 200


async def test_lifespan_starts_and_closes_the_node(tmp_path: Path) -> None:
    h = build(tmp_path, api_key=API_KEY)  # built, not started: the lifespan starts it
    app = node_app(h.settings, h.orch)
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    outbox: asyncio.Queue[Message] = asyncio.Queue()

    async def receive() -> Message:
        return await inbox.get()

    async def send(message: Message) -> None:
        await outbox.put(message)

    task = asyncio.ensure_future(app({"type": "lifespan", "state": {}}, receive, send))
    try:
        assert h.runtime.ops() == []
        await inbox.put({"type": "lifespan.startup"})
        assert (await outbox.get())["type"] == "lifespan.startup.complete"
        assert h.runtime.ops()[:1] == ["start"]  # recovery of what a last run left
        async with api_client(h) as c:  # and the node takes sandboxes
            assert (await c.post("/v2/sandboxes", json={"templateID": "base"})).status_code == 201
        assert not h.orch.context.closing
        await inbox.put({"type": "lifespan.shutdown"})
        assert (await outbox.get())["type"] == "lifespan.shutdown.complete"
        await task
        assert h.orch.context.closing and h.runtime.ops()[-1] == "close"
    finally:
        h.catalog.close()


# --------------------------------------------------------------------------------------------
# create


async def test_create_v2_shape_and_mapping(client: httpx.AsyncClient, node: Harness) -> None:
    r = await client.post(
        "/v2/sandboxes",
        json={
            "templateID": "base",
            "timeout": 60,
            "metadata": {"team": "alpha"},
            "envVars": {"A": "1"},
            "autoPause": True,
            "autoPauseMemory": False,
            "allow_internet_access": False,
            "cpuCount": 4,
            "memoryMB": 1024,
            "network": {
                "allowPublicTraffic": False,
                "allowOut": ["203.0.113.7"],
                "maskRequestHost": "localhost:${PORT}",
            },
            "mcp": None,
            "somethingNew": [1, 2],
        },
    )
    assert r.status_code == 201, r.text
    body = r.json()
    (rec,) = node.orch.table.list()
    assert body == {
        "sandboxID": rec.sandbox_id,
        "templateID": "base",
        "clientID": "aenv",
        "envdVersion": "0.6.4",
        "alias": "base",
        "envdAccessToken": rec.envd_access_token,
        "trafficAccessToken": rec.traffic_access_token,
        "domain": None,
    }
    assert body["envdAccessToken"] and body["trafficAccessToken"]  # private: both tokens
    # What the node made of each field.
    egress = EgressPolicy(allow_internet=False, allow_out=["203.0.113.7/32"])
    assert (rec.metadata, rec.env_vars) == ({"team": "alpha"}, {"A": "1"})
    assert (rec.auto_pause, rec.auto_pause_memory, rec.auto_resume) == (True, False, False)
    assert rec.timeout == 60  # what an auto-resume gives it again
    assert rec.end_at == node.clock.now + timedelta(seconds=60)
    assert (rec.egress, rec.mask_request_host) == (egress, "localhost:${PORT}")
    assert rec.instance is not None
    container = node.host.containers[rec.instance.id]
    assert (container.cpu_count, container.memory_mb) == (4, 1024)
    assert container.egress == egress
    (_, init), *_ = node.envd.inits
    assert init["env_vars"] == {"LANG": "C.UTF-8", "A": "1"}  # the template's, then the request's
    assert init["token"] == rec.envd_access_token


async def test_create_defaults(client: httpx.AsyncClient, node: Harness) -> None:
    r = await client.post("/v2/sandboxes", json={"templateID": "base"})
    assert r.status_code == 201
    rec = node.orch.table.get(r.json()["sandboxID"])
    assert r.json()["envdAccessToken"] == rec.envd_access_token != ""
    assert r.json()["trafficAccessToken"] is None  # public by default
    assert rec.end_at == node.clock.now + timedelta(seconds=node.settings.default_timeout)
    assert (rec.cpu_count, rec.memory_mb) == (2, 512)  # the template's
    assert (rec.metadata, rec.env_vars, rec.egress) == ({}, {}, EgressPolicy())
    assert (rec.auto_pause, rec.auto_resume) == (False, False)
    # v1: `secure` (AgentENV's) changes nothing; every sandbox's envd wants a token.
    for extra in ({}, {"secure": False}, {"secure": True}):
        r = await client.post("/sandboxes", json={"templateID": "base", "timeout": 60, **extra})
        assert r.status_code == 201
        rec = node.orch.table.get(r.json()["sandboxID"])
        assert rec.end_at == node.clock.now + timedelta(seconds=60)
        assert r.json()["envdAccessToken"] == rec.envd_access_token != ""
        assert r.json()["trafficAccessToken"] is None
    assert len(node.orch.table.list()) == 4


async def test_domain_is_returned_and_routes_sandbox_hosts(tmp_path: Path) -> None:
    """With AENV_DOMAIN the node names it in create, connect and get (the SDKs build the
    sandbox hosts from it) and routes `{port}-{id}.{domain}` to the sandbox, the rest of
    the names under it (`api.{domain}`) to the control plane."""
    async for h in started(tmp_path, api_key=API_KEY, domain="aenv.example.com:8443"):
        async with api_client(h, base_url="http://api.aenv.example.com:8443") as c:
            r = await c.post("/v2/sandboxes", json={"templateID": "base"})
            assert r.status_code == 201 and r.json()["domain"] == "aenv.example.com:8443"
            sid = r.json()["sandboxID"]
            r = await c.get(f"/sandboxes/{sid}")
            assert r.status_code == 200 and r.json()["domain"] == "aenv.example.com:8443"
            r = await c.post(f"/sandboxes/{sid}/connect", json={"timeout": 60})
            assert r.json()["domain"] == "aenv.example.com:8443"
            # A sandbox host goes to the proxy, which knows no sandbox `nosuch`.
            r = await c.get("/health", headers={"host": "49983-nosuch.aenv.example.com:8443"})
            assert assert_error(r, 502)["sandboxId"] == "nosuch"


async def test_create_accepts_chunked_body(client: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"templateID":'
        yield b'"base"}'

    r = await client.post(
        "/v2/sandboxes", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 201, r.text


def _stages(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(", "):
        name, _, dur = part.partition(";dur=")
        out[name] = float(dur)
    return out


async def test_server_timing_header(client: httpx.AsyncClient, node: Harness) -> None:
    node.runtime.delay = 0.02  # every runtime call takes 20 ms
    r = await client.post("/v2/sandboxes", json={"templateID": "base"})
    stages = _stages(r.headers["server-timing"])
    assert list(stages) == ["boot", "envd-ready", "envd-init"]
    assert stages["boot"] >= 20
    sid = r.json()["sandboxID"]
    # Connect on a running sandbox times nothing: no header.
    r = await client.post(f"/v2/sandboxes/{sid}/connect")
    assert r.status_code == 200 and "server-timing" not in r.headers
    # The header shows the stages of its request only: the pause's freeze, then the thaw.
    r = await client.post(f"/sandboxes/{sid}/pause")
    assert list(_stages(r.headers["server-timing"])) == ["freeze"]
    r = await client.post(f"/v2/sandboxes/{sid}/connect")
    assert r.status_code == 201
    stages = _stages(r.headers["server-timing"])
    assert list(stages) == ["thaw"] and stages["thaw"] >= 20


def test_server_timing_names_are_http_tokens() -> None:
    timings = Timings()
    timings.stages.update({"boot": 12.345, "envd wait": 3, "": 1})
    assert timings.header() == "boot;dur=12.3, envd_wait;dur=3.0, step;dur=1.0"
    assert Timings().header() == ""


async def test_idempotency_key(client: httpx.AsyncClient, node: Harness) -> None:
    node.runtime.delay = 0.01  # overlapping creates interleave
    h = {"Idempotency-Key": "retry-1"}
    r1 = await client.post("/v2/sandboxes", json={"templateID": "base"}, headers=h)
    r2 = await client.post("/sandboxes", json={"templateID": "base"}, headers=h)
    assert r1.status_code == r2.status_code == 201
    assert r1.json() == r2.json()
    assert len(node.orch.table.list()) == 1
    r3 = await client.post(
        "/v2/sandboxes", json={"templateID": "base"}, headers={"Idempotency-Key": "other"}
    )
    assert r3.json()["sandboxID"] != r1.json()["sandboxID"]
    # Overlapping retries of one key create one sandbox.
    rs = await asyncio.gather(
        *[
            client.post(
                "/v2/sandboxes", json={"templateID": "base"}, headers={"Idempotency-Key": "k2"}
            )
            for _ in range(5)
        ]
    )
    assert len({r.json()["sandboxID"] for r in rs}) == 1
    assert len(node.orch.table.list()) == 3
    assert node.runtime.ops().count("create") == 3


@pytest.mark.parametrize("key", ["", "UPPER", "has space", "a" * 256, "semi;colon"])
async def test_idempotency_key_invalid(client: httpx.AsyncClient, key: str) -> None:
    r = await client.post(
        "/v2/sandboxes", json={"templateID": "base"}, headers={"Idempotency-Key": key}
    )
    assert "Idempotency-Key" in assert_error(r, 400)["message"]


async def test_idempotency_cache_expires_and_forgets_failures() -> None:
    now = [0.0]
    cache = IdempotencyCache(ttl=600, clock=lambda: now[0])
    n = [0]

    async def make() -> int:
        n[0] += 1
        return n[0]

    assert await cache.run("k", make) == 1
    now[0] = 599
    assert await cache.run("k", make) == 1
    now[0] = 601
    assert await cache.run("k", make) == 2
    assert await cache.run(None, make) == 3

    async def fail() -> int:
        raise BadRequest("nope")

    with pytest.raises(BadRequest):
        await cache.run("f", fail)
    assert await cache.run("f", make) == 4


@pytest.mark.parametrize(
    ("network", "needle"),
    [
        ({"allowOut": ["exa mple.com"]}, "not an IPv4 address, CIDR block or domain name"),
        ({"denyOut": ["10.0.0.0/33"]}, "denyOut"),
        ({"allowOut": ["::1"]}, "IPv4"),
        ({"dnsServers": ["resolver"]}, "dnsServers"),
        ({"egressProxy": {"address": "127.0.0.1:1080"}}, "egressProxy"),
    ],
)
async def test_create_refuses_bad_network_rules(
    client: httpx.AsyncClient, node: Harness, network: dict[str, Any], needle: str
) -> None:
    r = await client.post("/v2/sandboxes", json={"templateID": "base", "network": network})
    assert_error(r, 400)
    assert needle in r.json()["message"]
    assert_nothing_created(node)


async def test_domain_rules_are_accepted_normalized_and_in_force(
    client: httpx.AsyncClient, node: Harness
) -> None:
    network = {"allowOut": ["Example.COM.", "*.wild.test"], "denyOut": ["0.0.0.0/0"]}
    r = await client.post("/v2/sandboxes", json={"templateID": "base", "network": network})
    assert r.status_code == 201, r.text
    want = EgressPolicy(allow_out=["example.com", "*.wild.test"], deny_out=["0.0.0.0/0"])
    rec = node.orch.table.get(r.json()["sandboxID"])
    assert rec.egress == want
    assert rec.instance is not None and node.runtime.egress(rec.instance) == want
    info = (await client.get(f"/sandboxes/{rec.sandbox_id}")).json()
    assert info["network"]["allowOut"] == ["example.com", "*.wild.test"]


async def test_oversized_bodies_are_refused(client: httpx.AsyncClient, node: Harness) -> None:
    big = {"templateID": "base", "metadata": {"k": "x" * (2 << 20)}}
    assert_error(await client.post("/v2/sandboxes", json=big), 413)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"templateID": "base", "metadata": {"k": "'
        for _ in range(20):
            yield b"x" * (128 << 10)
        yield b'"}}'

    assert_error(await client.post("/v2/sandboxes", content=chunks()), 413)
    assert_nothing_created(node)

    async def small() -> AsyncIterator[bytes]:
        yield b'{"templateID":'
        yield b' "base"}'

    r = await client.post(
        "/v2/sandboxes", content=small(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 201, r.text
    (rec,) = node.orch.table.list()
    assert rec.template_id == "base" and rec.state is State.RUNNING
    assert rec.instance is not None and node.runtime.state(rec.instance) is FakeState.RUNNING
