"""The control-plane API over an in-memory fake orchestrator: status codes, JSON shapes, auth,
pagination, validation, idempotency, and the real e2b SDK parsing our responses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import pytest

from aenv.api.idempotency import IdempotencyCache
from aenv.api.listing import Cursor, paginate, parse_metadata_filter
from aenv.config import Settings
from aenv.domain import CreateRequest, EgressPolicy, SandboxRecord, Timings, Upstream
from aenv.domain import SandboxState as State
from aenv.errors import BadRequest, Conflict, NotFound
from aenv.server import node_app
from tests.helpers import uvicorn_thread

API_KEY = "e2b_test_key_0123456789"
BASE = datetime(2025, 1, 1, tzinfo=UTC)


class FakeOrchestrator:
    """In-memory stand-in with the surface of the Orchestrator's parts that the API calls,
    and their error semantics."""

    def __init__(self) -> None:
        self.records: dict[str, SandboxRecord] = {}
        self.requests: list[CreateRequest] = []
        self.calls: list[tuple[str, Any]] = []
        self.started = False
        self.closed = False
        # Stages (ms) the fake reports into the `Timings` a lifecycle call is given.
        self.timings: dict[str, float] | None = None
        self._n = 0

    # The parts the API calls, all of them this one fake.
    @property
    def table(self) -> FakeOrchestrator:
        return self

    @property
    def sandboxes(self) -> FakeOrchestrator:
        return self

    @property
    def pauser(self) -> FakeOrchestrator:
        return self

    @property
    def context(self) -> FakeOrchestrator:
        return self

    async def start(self) -> None:
        self.started = True

    def _time(self, timings: Timings | None) -> None:
        if timings is not None and self.timings is not None:
            timings.stages.update(self.timings)

    async def close(self) -> None:
        self.closed = True

    def add(self, state: State = State.RUNNING, **kw: Any) -> SandboxRecord:
        self._n += 1
        sid = kw.pop("sandbox_id", f"sbx{self._n:04d}")
        started = kw.pop("started_at", BASE + timedelta(seconds=self._n))
        r = SandboxRecord(
            sandbox_id=sid,
            template_id=kw.pop("template_id", "base"),
            alias=kw.pop("alias", "base"),
            client_id="aenv",
            started_at=started,
            end_at=started + timedelta(seconds=300),
            cpu_count=2,
            memory_mb=512,
            disk_mb=1024,
            state=state,
            envd_version="0.6.4",
            envd_access_token=kw.pop("envd_access_token", f"tok-{sid}"),
            **kw,
        )
        self.records[sid] = r
        return r

    async def create(self, req: CreateRequest, timings: Timings | None = None) -> SandboxRecord:
        if req.template_id == "missing":
            raise NotFound(f"template {req.template_id!r} not found")
        await asyncio.sleep(0.01)  # let overlapping requests interleave
        self.requests.append(req)
        r = self.add(
            template_id=req.template_id,
            metadata=dict(req.metadata),
            env_vars=dict(req.env_vars),
            auto_pause=req.auto_pause,
            auto_resume=req.auto_resume,
            envd_access_token="secret",
            traffic_access_token="" if req.public_traffic else "traffic-secret",
        )
        self._time(timings)
        return r

    def get(self, sandbox_id: str) -> SandboxRecord:
        # Unlike the real one, returns killing/killed records: the API must hide them itself.
        r = self.records.get(sandbox_id)
        if r is None:
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        return r

    def list(
        self,
        *,
        metadata: dict[str, str] | None = None,
        states: set[str] | None = None,
        template: str | None = None,
    ) -> list[SandboxRecord]:
        self.calls.append(("list", (metadata, states, template)))
        out = []
        for r in self.records.values():
            if r.state not in (State.RUNNING, State.PAUSED):
                continue
            if states and r.state.value not in states:
                continue
            if template and template not in (r.template_id, r.alias):
                continue
            if metadata and any(r.metadata.get(k) != v for k, v in metadata.items()):
                continue
            out.append(r)
        return sorted(out, key=lambda r: (r.started_at, r.sandbox_id))

    async def kill(self, sandbox_id: str) -> None:
        self.get(sandbox_id)
        del self.records[sandbox_id]

    async def set_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord:  # noqa: ASYNC109
        r = self.get(sandbox_id)
        r.end_at = datetime.now(UTC) + timedelta(seconds=timeout)
        self.calls.append(("set_timeout", (sandbox_id, timeout)))
        return r

    async def update_network(self, sandbox_id: str, policy: EgressPolicy) -> SandboxRecord:
        r = self.get(sandbox_id)
        self.calls.append(("update_network", (sandbox_id, policy)))
        r.egress = policy
        return r

    async def refresh(self, sandbox_id: str, duration: int | None) -> SandboxRecord:
        r = self.get(sandbox_id)
        self.calls.append(("refresh", (sandbox_id, duration)))
        return r

    async def connect(
        self,
        sandbox_id: str,
        timeout: int | None,  # noqa: ASYNC109 (the Pauser's signature)
        memory: bool | None = None,
        timings: Timings | None = None,
    ) -> tuple[SandboxRecord, bool]:
        r = self.get(sandbox_id)
        self.calls.append(("connect", (sandbox_id, timeout, memory)))
        self._time(timings)
        if r.state is State.PAUSED:
            r.state = State.RUNNING
            return r, True
        return r, False

    async def pause(
        self,
        sandbox_id: str,
        memory: bool = True,
        timings: Timings | None = None,
        *,
        require_healthy_guest: bool = False,
    ) -> None:
        r = self.get(sandbox_id)
        self.calls.append(("pause", (sandbox_id, memory)))
        if require_healthy_guest:
            self.calls.append(("pause-strict", sandbox_id))
        if r.state is State.PAUSED:
            raise Conflict(f"sandbox {sandbox_id!r} is already paused")
        r.state = State.PAUSED
        self._time(timings)

    async def resolve(
        self, sandbox_id: str, port: int, traffic_token: str | None = None
    ) -> Upstream:
        self.get(sandbox_id)
        return Upstream("127.0.0.1", port)

    async def expose(self, sandbox_id: str, port: int) -> bool:
        return False

    quotas: Callable[[str], object] | None = None

    def on_stopped(self, listener: Callable[[str], None]) -> None:
        pass

    def signed_by(self, path: str, op: str, user: str, sig: str, exp: str | None) -> str | None:
        return None


@pytest.fixture
def settings(tmp_path: Any) -> Settings:
    return Settings(api_key=API_KEY, home=tmp_path)


@pytest.fixture
def orch() -> FakeOrchestrator:
    return FakeOrchestrator()


@pytest.fixture
async def client(settings: Settings, orch: FakeOrchestrator) -> AsyncIterator[httpx.AsyncClient]:
    app = node_app(settings, orch)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://test", headers={"X-API-Key": API_KEY}
    ) as c:
        yield c


def assert_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["code"] == status
    assert isinstance(body["message"], str) and body["message"]
    return dict(body)


# --------------------------------------------------------------------------------------------
# health, auth, errors


async def test_health_needs_no_key(client: httpx.AsyncClient) -> None:
    r = await client.get("/health", headers={"X-API-Key": ""})
    assert r.status_code == 204
    assert r.content == b""
    r = await httpx.AsyncClient(transport=client._transport, base_url="http://test").get("/health")
    assert r.status_code == 204


async def test_sandbox_headers_go_to_the_data_plane(client: httpx.AsyncClient) -> None:
    # `/health` exists on both planes; the E2b-Sandbox-Id header decides (no such sandbox here).
    r = await client.get("/health", headers={"E2b-Sandbox-Id": "nope", "E2b-Sandbox-Port": "49983"})
    assert_error(r, 404)
    assert (await client.get("/health")).status_code == 204


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
        [("X-API-Key", "secret")],  # a sandbox's envd token is no API key
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
async def test_auth_rejections(
    settings: Settings, orch: FakeOrchestrator, headers: list[tuple[str, str]]
) -> None:
    app = node_app(settings, orch)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for path in ("/sandboxes", "/v2/sandboxes"):
            r = await c.get(path, headers=headers)
            assert_error(r, 401)
        r = await c.post("/v2/sandboxes", headers=headers, json={"templateID": "base"})
        assert_error(r, 401)
    assert orch.requests == []


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


async def test_template_not_found_is_404(client: httpx.AsyncClient) -> None:
    assert_error(await client.post("/v2/sandboxes", json={"templateID": "missing"}), 404)


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
    client: httpx.AsyncClient, orch: FakeOrchestrator, body: dict[str, Any], needle: str
) -> None:
    for path in ("/sandboxes", "/v2/sandboxes"):
        err = assert_error(await client.post(path, json=body), 400)
        assert needle in err["message"]
    assert orch.requests == []


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


async def test_unexpected_exception_is_json_500(
    client: httpx.AsyncClient, orch: FakeOrchestrator
) -> None:
    def boom(sandbox_id: str) -> SandboxRecord:
        raise RuntimeError("kaboom")

    orch.get = boom  # type: ignore[method-assign]
    assert "kaboom" in assert_error(await client.get("/sandboxes/x"), 500)["message"]


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


async def test_lifespan_starts_and_closes_orchestrator(settings: Settings) -> None:
    orch = FakeOrchestrator()
    app = node_app(settings, orch)  # type: ignore[arg-type]
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def receive() -> dict[str, Any]:
        return await inbox.get()

    async def send(message: dict[str, Any]) -> None:
        await outbox.put(message)

    scope = {"type": "lifespan", "state": {}}
    task: asyncio.Task[None] = asyncio.create_task(app(scope, receive, send))  # type: ignore[arg-type]
    await inbox.put({"type": "lifespan.startup"})
    assert (await outbox.get())["type"] == "lifespan.startup.complete"
    assert orch.started and not orch.closed
    await inbox.put({"type": "lifespan.shutdown"})
    assert (await outbox.get())["type"] == "lifespan.shutdown.complete"
    await task
    assert orch.closed


# --------------------------------------------------------------------------------------------
# create


async def test_create_v2_shape_and_mapping(
    client: httpx.AsyncClient, orch: FakeOrchestrator
) -> None:
    r = await client.post(
        "/v2/sandboxes",
        json={
            "templateID": "base",
            "timeout": 60,
            "metadata": {"team": "alpha"},
            "envVars": {"A": "1"},
            "autoPause": True,
            "autoPauseMemory": False,
            "autoResume": {"enabled": True},
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
    assert body == {
        "sandboxID": body["sandboxID"],
        "templateID": "base",
        "clientID": "aenv",
        "envdVersion": "0.6.4",
        "alias": "base",
        "envdAccessToken": "secret",
        "trafficAccessToken": "traffic-secret",
        "domain": None,
    }
    (req,) = orch.requests
    assert req == CreateRequest(
        template_id="base",
        timeout=60,
        metadata={"team": "alpha"},
        env_vars={"A": "1"},
        cpu_count=4,
        memory_mb=1024,
        auto_pause=True,
        auto_pause_memory=False,
        auto_resume=True,
        egress=EgressPolicy(allow_internet=False, allow_out=["203.0.113.7/32"]),
        public_traffic=False,
        mask_request_host="localhost:${PORT}",
    )


async def test_create_defaults(client: httpx.AsyncClient, orch: FakeOrchestrator) -> None:
    r = await client.post("/v2/sandboxes", json={"templateID": "base"})
    assert r.status_code == 201
    assert orch.requests[-1] == CreateRequest(template_id="base")
    assert r.json()["envdAccessToken"] == "secret"
    # v1: `secure` (AgentENV's) changes nothing; every sandbox's envd wants a token.
    for extra in ({}, {"secure": False}, {"secure": True}):
        r = await client.post("/sandboxes", json={"templateID": "base", "timeout": 60, **extra})
        assert r.status_code == 201
        assert orch.requests[-1] == CreateRequest(template_id="base", timeout=60)
        assert r.json()["envdAccessToken"] == "secret"
        assert r.json()["trafficAccessToken"] is None


async def test_domain_is_returned_and_routes_sandbox_hosts(
    tmp_path: Any, orch: FakeOrchestrator
) -> None:
    """With AENV_DOMAIN the node names it in create, connect and get (the SDKs build the
    sandbox hosts from it) and routes `{port}-{id}.{domain}` to the sandbox, the rest of
    the names under it (`api.{domain}`) to the control plane."""
    settings = Settings(api_key=API_KEY, home=tmp_path, domain="aenv.example.com:8443")
    app = node_app(settings, orch)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport,
        base_url="http://api.aenv.example.com:8443",
        headers={"X-API-Key": API_KEY},
    ) as c:
        r = await c.post("/v2/sandboxes", json={"templateID": "base"})
        assert r.status_code == 201 and r.json()["domain"] == "aenv.example.com:8443"
        sid = r.json()["sandboxID"]
        r = await c.get(f"/sandboxes/{sid}")
        assert r.status_code == 200 and r.json()["domain"] == "aenv.example.com:8443"
        r = await c.post(f"/sandboxes/{sid}/connect", json={"timeout": 60})
        assert r.json()["domain"] == "aenv.example.com:8443"
        # A sandbox host goes to the resolver (the fake one answers 404 for unknown ids).
        r = await c.get("/health", headers={"host": "49983-nosuch.aenv.example.com:8443"})
        assert_error(r, 404)


async def test_create_accepts_chunked_body(client: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"templateID":'
        yield b'"base"}'

    r = await client.post(
        "/v2/sandboxes", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 201, r.text


async def test_server_timing_header(client: httpx.AsyncClient, orch: FakeOrchestrator) -> None:
    r = await client.post("/v2/sandboxes", json={"templateID": "base"})
    assert "server-timing" not in r.headers
    orch.timings = {"boot": 12.345, "envd wait": 3}
    r = await client.post("/v2/sandboxes", json={"templateID": "base"})
    assert r.headers["server-timing"] == "boot;dur=12.3, envd_wait;dur=3.0"
    # On connect as well: the header shows the stages of this request only.
    rec = orch.records[r.json()["sandboxID"]]
    rec.state = State.PAUSED
    orch.timings = {"thaw": 1.25}
    r = await client.post(f"/v2/sandboxes/{rec.sandbox_id}/connect")
    assert r.status_code == 201 and r.headers["server-timing"] == "thaw;dur=1.2"


async def test_idempotency_key(client: httpx.AsyncClient, orch: FakeOrchestrator) -> None:
    h = {"Idempotency-Key": "retry-1"}
    r1 = await client.post("/v2/sandboxes", json={"templateID": "base"}, headers=h)
    r2 = await client.post("/sandboxes", json={"templateID": "base"}, headers=h)
    assert r1.status_code == r2.status_code == 201
    assert r1.json() == r2.json()
    assert len(orch.requests) == 1
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
    assert len(orch.requests) == 3


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


# --------------------------------------------------------------------------------------------
# get / list


async def test_get_detail_shape(client: httpx.AsyncClient, orch: FakeOrchestrator) -> None:
    rec = orch.add(metadata={"a": "b"}, auto_pause=True, auto_resume=True)
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
        "diskSizeMB": 1024,
        "state": "running",
        "envdVersion": "0.6.4",
        "metadata": {"a": "b"},
        "envdAccessToken": f"tok-{rec.sandbox_id}",
        "allowInternetAccess": True,
        "network": {
            "allowPublicTraffic": True,
            "allowOut": [],
            "denyOut": [],
        },
        "domain": None,
        "lifecycle": {"autoResume": True, "onTimeout": "pause"},
    }
    assert datetime.fromisoformat(body["startedAt"]) == rec.started_at
    assert datetime.fromisoformat(body["endAt"]).tzinfo is not None

    rec2 = orch.add(State.PAUSED, envd_access_token="")
    body = (await client.get(f"/sandboxes/{rec2.sandbox_id}")).json()
    assert body["state"] == "paused"
    assert body["lifecycle"] == {"autoResume": False, "onTimeout": "kill"}
    assert "envdAccessToken" not in body


async def test_naive_timestamps_get_a_timezone(
    client: httpx.AsyncClient, orch: FakeOrchestrator
) -> None:
    rec = orch.add(started_at=datetime(2025, 1, 1, 12, 0, 0))
    body = (await client.get(f"/sandboxes/{rec.sandbox_id}")).json()
    assert datetime.fromisoformat(body["startedAt"]).utcoffset() == timedelta(0)


async def test_killing_sandbox_is_invisible(
    client: httpx.AsyncClient, orch: FakeOrchestrator
) -> None:
    for state in (State.KILLING, State.KILLED):
        rec = orch.add(state)
        assert_error(await client.get(f"/sandboxes/{rec.sandbox_id}"), 404)
        assert_error(await client.post(f"/sandboxes/{rec.sandbox_id}/resume"), 404)


async def test_list_v1(client: httpx.AsyncClient, orch: FakeOrchestrator) -> None:
    a = orch.add(metadata={"team": "alpha"})
    b = orch.add(metadata={"team": "beta"})
    orch.add(State.PAUSED, metadata={"team": "alpha"})
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


async def test_list_v2_filters(client: httpx.AsyncClient, orch: FakeOrchestrator) -> None:
    a = orch.add(metadata={"team": "alpha", "x": "a b&c=d"})
    b = orch.add(State.PAUSED, metadata={"team": "alpha"}, template_id="tpl2", alias="py")
    c = orch.add(metadata={"team": "beta"})

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


async def test_pagination_limit_1(client: httpx.AsyncClient, orch: FakeOrchestrator) -> None:
    group = [orch.add(metadata={"suite": "g1"}) for _ in range(3)]
    orch.add(metadata={"suite": "other"})
    # Two sandboxes with the same start time: the id breaks the tie.
    same = BASE + timedelta(hours=1)
    group += [orch.add(metadata={"suite": "g1"}, started_at=same) for _ in range(2)]
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


async def test_pagination_last_page_has_no_token(
    client: httpx.AsyncClient, orch: FakeOrchestrator
) -> None:
    for _ in range(4):
        orch.add()
    r = await client.get("/v2/sandboxes", params={"limit": 2})
    assert len(r.json()) == 2 and r.headers["x-next-token"]
    r = await client.get(
        "/v2/sandboxes", params={"limit": 2, "nextToken": r.headers["x-next-token"]}
    )
    assert len(r.json()) == 2
    assert "x-next-token" not in r.headers  # exactly full last page: no empty trailing page
    r = await client.get("/v2/sandboxes", params={"limit": 100})
    assert len(r.json()) == 4 and "x-next-token" not in r.headers


def test_paginate_survives_deletion_between_pages() -> None:
    orch = FakeOrchestrator()
    recs = [orch.add() for _ in range(5)]
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


# --------------------------------------------------------------------------------------------
# lifecycle


async def test_kill(client: httpx.AsyncClient, orch: FakeOrchestrator) -> None:
    rec = orch.add()
    r = await client.delete(f"/sandboxes/{rec.sandbox_id}")
    assert r.status_code == 204 and r.content == b""
    assert_error(await client.get(f"/sandboxes/{rec.sandbox_id}"), 404)
    assert_error(await client.delete(f"/sandboxes/{rec.sandbox_id}"), 404)


async def test_timeout_and_refresh(client: httpx.AsyncClient, orch: FakeOrchestrator) -> None:
    rec = orch.add()
    sid = rec.sandbox_id
    assert (
        await client.post(f"/sandboxes/{sid}/timeout", json={"timeout": 120})
    ).status_code == 204
    assert ("set_timeout", (sid, 120)) in orch.calls
    assert_error(await client.post(f"/sandboxes/{sid}/timeout", json={}), 400)
    assert_error(await client.post(f"/sandboxes/{sid}/timeout", json={"timeout": 86401}), 400)
    r = await client.post(f"/sandboxes/{sid}/refreshes", json={"duration": 300})
    assert r.status_code == 204
    assert (await client.post(f"/sandboxes/{sid}/refreshes")).status_code == 204
    assert ("refresh", (sid, 300)) in orch.calls and ("refresh", (sid, None)) in orch.calls
    assert_error(await client.post(f"/sandboxes/{sid}/refreshes", json={"duration": 3601}), 400)


async def test_pause_connect_resume(client: httpx.AsyncClient, orch: FakeOrchestrator) -> None:
    sid = orch.add().sandbox_id
    # v1 connect on a running sandbox: 200; v1 needs a timeout.
    r = await client.post(f"/sandboxes/{sid}/connect", json={"timeout": 60})
    assert r.status_code == 200 and r.json()["sandboxID"] == sid
    assert_error(await client.post(f"/sandboxes/{sid}/connect", json={}), 400)
    # resume on a running sandbox: 409, and it must not touch the sandbox.
    n_calls = len(orch.calls)
    assert_error(await client.post(f"/sandboxes/{sid}/resume", json={}), 409)
    assert len(orch.calls) == n_calls

    r = await client.post(f"/sandboxes/{sid}/pause", json={})
    assert r.status_code == 204 and r.content == b""
    assert ("pause", (sid, True)) in orch.calls
    assert_error(await client.post(f"/sandboxes/{sid}/pause"), 409)
    assert (await client.get(f"/sandboxes/{sid}")).json()["state"] == "paused"

    # v2 connect resumes: 201; empty body and no body both work.
    r = await client.post(f"/v2/sandboxes/{sid}/connect", json={})
    assert r.status_code == 201
    assert r.json() == {
        "sandboxID": sid,
        "templateID": "base",
        "clientID": "aenv",
        "envdVersion": "0.6.4",
        "alias": "base",
        "envdAccessToken": f"tok-{sid}",
        "trafficAccessToken": None,
        "domain": None,
    }
    assert ("connect", (sid, None, None)) in orch.calls
    r = await client.post(f"/v2/sandboxes/{sid}/connect")
    assert r.status_code == 200

    r = await client.post(
        f"/sandboxes/{sid}/pause", json={"memory": False, "requireHealthyGuest": True}
    )
    assert r.status_code == 204
    assert ("pause", (sid, False)) in orch.calls
    assert ("pause-strict", sid) in orch.calls
    r = await client.post(f"/sandboxes/{sid}/resume", json={"timeout": 30, "autoPause": True})
    assert r.status_code == 201 and r.json()["sandboxID"] == sid
    assert ("connect", (sid, 30, None)) in orch.calls

    orch.records[sid].state = State.PAUSED
    r = await client.post(f"/sandboxes/{sid}/connect", json={"timeout": 60, "memory": False})
    assert r.status_code == 201
    assert ("connect", (sid, 60, False)) in orch.calls
    assert_error(await client.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": -5}), 400)


# --------------------------------------------------------------------------------------------
# the real e2b SDK against the app served by uvicorn


@pytest.fixture
def served(settings: Settings) -> Iterator[tuple[str, FakeOrchestrator]]:
    orch = FakeOrchestrator()
    app = node_app(settings, orch)  # type: ignore[arg-type]
    with uvicorn_thread(app, lifespan="on") as url:
        yield url, orch


def test_e2b_sdk_parses_our_responses(served: tuple[str, FakeOrchestrator]) -> None:
    from e2b import Sandbox, SandboxQuery, SandboxState

    url, orch = served
    opts: dict[str, Any] = {"api_key": API_KEY, "api_url": url, "sandbox_url": url}
    group = [orch.add(metadata={"suite": "sdk", "n": str(i)}) for i in range(3)]
    paused = orch.add(State.PAUSED, metadata={"suite": "sdk-paused"}, auto_pause=True)
    assert orch.started

    # Pagination through the SDK's paginator (limit=1, x-next-token).
    paginator = Sandbox.list(query=SandboxQuery(metadata={"suite": "sdk"}), limit=1, **opts)
    seen = []
    while paginator.has_next:
        items = paginator.next_items()
        assert len(items) <= 1
        seen += [i.sandbox_id for i in items]
    assert sorted(seen) == sorted(g.sandbox_id for g in group)

    items = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED]), **opts).next_items()
    assert [i.sandbox_id for i in items] == [paused.sandbox_id]
    assert items[0].state == SandboxState.PAUSED
    assert items[0].metadata == {"suite": "sdk-paused"}

    info = Sandbox.get_info(group[0].sandbox_id, **opts)
    assert info.sandbox_id == group[0].sandbox_id
    assert info.template_id == "base" and info.name == "base"
    assert info.state == SandboxState.RUNNING
    assert info.metadata == {"suite": "sdk", "n": "0"}
    assert info.started_at == group[0].started_at
    assert info.cpu_count == 2 and info.memory_mb == 512
    assert info.lifecycle == {"on_timeout": "kill", "auto_resume": False}
    assert info.sandbox_domain is None
    assert Sandbox.get_info(paused.sandbox_id, **opts).lifecycle == {
        "on_timeout": "pause",
        "auto_resume": False,
    }

    Sandbox.set_timeout(group[0].sandbox_id, 120, **opts)
    assert Sandbox.pause(group[1].sandbox_id, **opts) is True
    assert Sandbox.pause(group[1].sandbox_id, **opts) is False  # 409: already paused

    assert Sandbox.kill(group[0].sandbox_id, **opts) is True
    assert Sandbox.kill(group[0].sandbox_id, **opts) is False
    assert Sandbox.kill("does-not-exist", **opts) is False

    from e2b.exceptions import AuthenticationException, SandboxNotFoundException

    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info("does-not-exist", **opts)
    with pytest.raises(AuthenticationException):
        Sandbox.get_info(group[1].sandbox_id, **{**opts, "api_key": "wrong"})


def test_e2b_sdk_create_and_connect(served: tuple[str, FakeOrchestrator]) -> None:
    from e2b import Sandbox

    url, orch = served
    opts: dict[str, Any] = {"api_key": API_KEY, "api_url": url, "sandbox_url": url}
    sbx = Sandbox.create(
        template="base", timeout=60, metadata={"k": "v"}, idempotency_key="abc-1", **opts
    )
    assert sbx.sandbox_id in orch.records
    assert orch.requests[-1].metadata == {"k": "v"} and orch.requests[-1].timeout == 60
    again = Sandbox.create(template="base", timeout=60, idempotency_key="abc-1", **opts)
    assert again.sandbox_id == sbx.sandbox_id
    orch.records[sbx.sandbox_id].state = State.PAUSED
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=90, **opts)
    assert resumed.sandbox_id == sbx.sandbox_id
    assert orch.records[sbx.sandbox_id].state is State.RUNNING


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
    client: httpx.AsyncClient, orch: FakeOrchestrator, network: dict[str, Any], needle: str
) -> None:
    r = await client.post("/v2/sandboxes", json={"templateID": "base", "network": network})
    assert_error(r, 400)
    assert needle in r.json()["message"]
    assert orch.requests == []


async def test_update_network_replaces_rules_and_shows_them(
    client: httpx.AsyncClient, orch: FakeOrchestrator
) -> None:
    sbx = orch.add()
    r = await client.put(
        f"/sandboxes/{sbx.sandbox_id}/network",
        json={"allowOut": ["198.51.100.0/24"], "denyOut": ["0.0.0.0/0"]},
    )
    assert r.status_code == 204, r.text
    assert orch.calls[-1] == (
        "update_network",
        (sbx.sandbox_id, EgressPolicy(allow_out=["198.51.100.0/24"], deny_out=["0.0.0.0/0"])),
    )
    info = (await client.get(f"/sandboxes/{sbx.sandbox_id}")).json()
    assert info["network"] == {
        "allowPublicTraffic": True,
        "allowOut": ["198.51.100.0/24"],
        "denyOut": ["0.0.0.0/0"],
    }
    assert info["allowInternetAccess"] is True
    # Omitted fields are cleared; snake_case allow_internet_access as E2B sends it.
    r = await client.put(
        f"/sandboxes/{sbx.sandbox_id}/network", json={"allow_internet_access": False}
    )
    assert r.status_code == 204
    assert orch.calls[-1][1][1] == EgressPolicy(allow_internet=False)
    assert (await client.get(f"/sandboxes/{sbx.sandbox_id}")).json()["allowInternetAccess"] is False
    assert_error(await client.put("/sandboxes/nope/network", json={}), 404)
    assert_error(
        await client.put(f"/sandboxes/{sbx.sandbox_id}/network", json={"allowOut": "x"}), 400
    )


async def test_domain_rules_are_accepted_normalized_and_shown(
    client: httpx.AsyncClient, orch: FakeOrchestrator
) -> None:
    network = {"allowOut": ["Example.COM.", "*.wild.test"], "denyOut": ["0.0.0.0/0"]}
    r = await client.post("/v2/sandboxes", json={"templateID": "base", "network": network})
    assert r.status_code == 201, r.text
    want = EgressPolicy(allow_out=["example.com", "*.wild.test"], deny_out=["0.0.0.0/0"])
    assert orch.requests[-1].egress == want
    sbx = orch.add()
    r = await client.put(
        f"/sandboxes/{sbx.sandbox_id}/network",
        json={"allowOut": ["api.example.com"], "denyOut": ["*.example.com"], "dnsServers": []},
    )
    assert r.status_code == 204, r.text
    assert orch.calls[-1][1][1].dns_servers == []  # none, not the default
    info = (await client.get(f"/sandboxes/{sbx.sandbox_id}")).json()
    assert info["network"]["allowOut"] == ["api.example.com"]
    assert info["network"]["denyOut"] == ["*.example.com"]
    assert info["network"]["dnsServers"] == []


async def test_oversized_bodies_are_refused(
    client: httpx.AsyncClient, orch: FakeOrchestrator
) -> None:
    big = {"templateID": "base", "metadata": {"k": "x" * (2 << 20)}}
    assert_error(await client.post("/v2/sandboxes", json=big), 413)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"templateID": "base", "metadata": {"k": "'
        for _ in range(20):
            yield b"x" * (128 << 10)
        yield b'"}}'

    assert_error(await client.post("/v2/sandboxes", content=chunks()), 413)

    async def small() -> AsyncIterator[bytes]:
        yield b'{"templateID":'
        yield b' "base"}'

    r = await client.post(
        "/v2/sandboxes", content=small(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 201, r.text
    assert orch.requests[-1].template_id == "base" and len(orch.requests) == 1
