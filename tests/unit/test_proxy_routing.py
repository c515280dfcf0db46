"""The data-plane proxy's routing, against real servers on loopback (tests/unit/proxy_env.py):
routing by headers, aliases, the /proxy prefix and the host, headers stripped and passed, bad
routes, resolver errors as JSON, signed file URLs, envd's internal routes, traffic tokens,
unreachable upstreams and the control plane's pass-through.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from websockets.asyncio.client import connect as ws_connect

from aenv.domain import Upstream
from aenv.proxy import SandboxRouter
from tests.unit.proxy_env import ENVD, Env, _no_control_app, proxy_servers

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env() -> AsyncIterator[Env]:
    async with proxy_servers() as value:
        yield value


# --------------------------------------------------------------------------- routing


async def test_header_routing_defaults_to_envd_port(env: Env) -> None:
    async with env.client() as c:
        r = await c.get("/health", headers={"e2b-sandbox-id": "sbx1"})
    assert r.status_code == 200
    assert r.json()["path"] == "/health"
    assert env.resolved[-1] == ("sbx1", 49983)


@pytest.mark.parametrize(
    ("headers", "expected_port"),
    [
        ({"e2b-sandbox-id": "sbx1", "e2b-sandbox-port": "49999"}, 49999),
        ({"x-agentenv-sandbox-id": "sbx1", "x-agentenv-target-port": "8080"}, 8080),
        ({"x-agentenv-sandbox-id": "sbx1", "e2b-sandbox-port": "3000"}, 3000),
        ({"e2b-sandbox-id": "sbx1", "x-agentenv-target-port": "5173"}, 5173),
    ],
)
async def test_header_routing_aliases(
    env: Env, headers: dict[str, str], expected_port: int
) -> None:
    async with env.client() as c:
        r = await c.post("/process.Process/List", headers=headers, content=b"{}")
    assert r.status_code == 200
    assert env.resolved[-1] == ("sbx1", expected_port)
    assert r.json()["path"] == "/process.Process/List"


async def test_headers_stripped_and_passed(env: Env) -> None:
    headers = {
        **ENVD,
        "x-agentenv-sandbox-id": "sbx1",
        "x-agentenv-target-port": "49983",
        "x-access-token": "tok",
        "authorization": "Basic dXNlcjo=",
        "cookie": "a=b",
        "x-custom": "1",
        "connection": "keep-alive, x-hop",
        "x-hop": "drop-me",
        "keep-alive": "timeout=5",
        "te": "trailers",
        "content-type": "application/json",
    }
    async with env.client() as c:
        r = await c.post("/a%20b/c%2Fd?x=1&y=%2F&z", headers=headers, content=b'{"k":1}')
    assert r.status_code == 200
    seen = r.json()
    h = seen["headers"]
    for name in (
        "e2b-sandbox-id",
        "e2b-sandbox-port",
        "x-agentenv-sandbox-id",
        "x-agentenv-target-port",
        "x-hop",
        "keep-alive",
        "te",
        "transfer-encoding",
    ):
        assert name not in h, name
    assert h["x-access-token"] == ["tok"]
    assert h["authorization"] == ["Basic dXNlcjo="]
    assert h["cookie"] == ["a=b"]
    assert h["x-custom"] == ["1"]
    assert h["content-type"] == ["application/json"]
    assert h["host"] == [f"127.0.0.1:{env.proxy_port}"]  # Host is passed unchanged
    assert h["content-length"] == ["7"]
    assert seen["raw_path"] == "/a%20b/c%2Fd"
    assert seen["query"] == "x=1&y=%2F&z"
    assert seen["body"] == '{"k":1}'
    # response side: end-to-end headers pass, hop-by-hop ones do not
    assert r.headers["x-upstream"] == "yes"
    assert "x-hop-resp" not in r.headers
    assert r.headers["content-type"] == "application/json"


async def test_proxy_prefix(env: Env) -> None:
    async with env.client() as c:
        r = await c.get("/proxy/health?q=1", headers=ENVD)
        assert r.status_code == 200 and r.json()["path"] == "/health"
        assert r.json()["query"] == "q=1"
        r = await c.get("/proxy", headers={"x-agentenv-sandbox-id": "sbx1"})
        assert r.status_code == 200 and r.json()["path"] == "/"
        r = await c.get("/proxy/health")
        assert r.status_code == 400
        assert r.headers["content-type"] == "application/json"
        assert r.json()["code"] == 400 and "sandbox" in r.json()["message"]
        r = await c.get("/proxy")
        assert r.status_code == 400
        r = await c.get("/proxyfoo")
        assert r.json() == {"plane": "control", "path": "/proxyfoo"}


async def test_host_routing(env: Env) -> None:
    async with env.client() as c:
        r = await c.get(
            "/index.html?a=b", headers={"host": f"8080-sbx1.localhost:{env.proxy_port}"}
        )
        assert r.status_code == 200
        assert env.resolved[-1] == ("sbx1", 8080)
        assert r.json()["path"] == "/index.html"
        assert r.json()["headers"]["host"] == [f"8080-sbx1.localhost:{env.proxy_port}"]
        r = await c.get("/proxy/x", headers={"host": "3000-sbx1.SBX.test"})
        assert r.status_code == 200 and r.json()["path"] == "/proxy/x"
        assert env.resolved[-1] == ("sbx1", 3000)
        # other names under the domain, and other domains, are the control plane
        for host in (
            "api.localhost",
            "localhost",
            "8080-sbx1.example.com",
            "a.8080-sbx1.localhost",
        ):
            r = await c.get("/sandboxes", headers={"host": host})
            assert r.json() == {"plane": "control", "path": "/sandboxes"}, host
        # malformed sandbox hosts are refused
        long_label = "8080-" + "a" * 59  # 64 characters
        for host in (f"{long_label}.localhost", "0-sbx1.localhost", "70000-sbx1.localhost"):
            r = await c.get("/", headers={"host": host})
            assert r.status_code == 400, host
            assert r.json()["code"] == 400
        ok_label = "8080-" + "a" * 58  # 63 characters
        r = await c.get("/", headers={"host": f"{ok_label}.localhost"})
        assert r.status_code == 200


async def test_route_parsing() -> None:
    async def resolver(sandbox_id: str, port: int, token: str | None) -> Upstream:
        raise AssertionError

    router = SandboxRouter(_no_control_app, resolver, ["Example.COM.", ""])

    def route(host: str, path: str = "/", **headers: str) -> object:
        hs = [(b"host", host.encode())] + [
            (k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()
        ]
        return router.route(
            {"type": "http", "path": path, "raw_path": path.encode(), "headers": hs}
        )

    r = route("49999-AbC123.example.com.:443")
    assert r is not None and (r.sandbox_id, r.port) == ("AbC123", 49999)  # type: ignore[attr-defined]
    assert route("[::1]:8000") is None
    assert route("example.com") is None
    assert route("www.example.com") is None
    assert route("localhost:8000") is None
    r = route("h", "/proxy/x", x_agentenv_sandbox_id="a", e2b_sandbox_id="b", e2b_sandbox_port="1")
    assert r is not None and (r.sandbox_id, r.port, r.strip_proxy_prefix) == ("a", 1, True)  # type: ignore[attr-defined]


async def test_bad_routing_headers(env: Env) -> None:
    async with env.client() as c:
        for headers in (
            {"e2b-sandbox-id": "sbx1", "e2b-sandbox-port": "http"},
            {"e2b-sandbox-id": "sbx1", "e2b-sandbox-port": "0"},
            {"e2b-sandbox-id": "sbx1", "e2b-sandbox-port": "65536"},
            {"e2b-sandbox-id": ""},
            {"e2b-sandbox-id": "../etc"},
        ):
            r = await c.get("/health", headers=headers)
            assert r.status_code == 400, headers
            assert r.json()["code"] == 400


async def test_resolver_errors_become_json(env: Env) -> None:
    async with env.client() as c:
        # E2B's edge answers: the SDKs read "was not found" in a 502 as "not running"
        r = await c.get("/health", headers={"e2b-sandbox-id": "missing"})
        assert r.status_code == 502
        assert r.json() == {
            "code": 502,
            "message": "The sandbox was not found",
            "sandboxId": "missing",
        }
        r = await c.get("/health", headers={"e2b-sandbox-id": "paused"})
        assert r.status_code == 502
        assert r.json()["message"] == "The sandbox was not found"
        assert r.json()["state"] == "paused"
        r = await c.get("/health", headers={"e2b-sandbox-id": "boom"})
        assert r.status_code == 500
        assert r.json()["code"] == 500


async def test_signed_file_urls_go_to_the_sandbox_that_signed(env: Env) -> None:
    """`download_url()` against the node's address (E2B_SANDBOX_URL) names no sandbox."""
    async with env.client() as c:
        r = await c.get("/files", params={"path": "/a b", "signature": "v1_+/"})
        assert r.status_code == 200 and r.json()["path"] == "/files"
        assert env.resolved[-1] == ("signer", 49983)
        r = await c.get("/proxy/files", params={"path": "/a b", "signature": "v1_+/"})
        assert r.status_code == 200 and r.json()["path"] == "/files"
        r = await c.get("/files", params={"path": "/a b", "signature": "v1_forged"})
        assert r.status_code == 401 and r.json()["message"] == "invalid signature"
        r = await c.get("/files", params={"path": "/a b"})
        assert r.json() == {"plane": "control", "path": "/files"}  # unsigned: not ours


@pytest.mark.parametrize(
    "path",
    ["/init", "/init/", "/%69nit", "/envs", "/metrics", "/logs", "/forward", "/oom", "/proxy/init"],
)
async def test_envd_internal_routes_are_refused(env: Env, path: str) -> None:
    before = len(env.resolved)
    async with env.client() as c:
        r = await c.post(path, headers=ENVD, content=b"{}")
    assert r.status_code == 403
    assert r.json()["code"] == 403 and "internal" in r.json()["message"]
    assert len(env.resolved) == before  # refused before the sandbox is looked up or woken
    # The same path on a user's own port is theirs.
    async with env.client() as c:
        r = await c.post(path, headers={"e2b-sandbox-id": "sbx1", "e2b-sandbox-port": "8080"})
    assert r.status_code == 200


async def test_traffic_token_goes_to_the_resolver_not_the_sandbox(env: Env) -> None:
    private = {"e2b-sandbox-id": "private", "e2b-sandbox-port": "8080"}
    async with env.client() as c:
        r = await c.get("/app", headers=private)
        assert r.status_code == 403 and r.json()["code"] == 403
        r = await c.get("/app", headers={**private, "e2b-traffic-access-token": "t0k"})
    assert r.status_code == 200
    seen = r.json()["headers"]
    assert "e2b-traffic-access-token" not in seen
    assert seen["host"] == ["masked:8080"]  # the sandbox's host mask, not the client's Host


async def test_unreachable_upstream_is_502(env: Env) -> None:
    async with env.client() as c:
        r = await c.get("/health", headers={"e2b-sandbox-id": "dead"})
    assert r.status_code == 502
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["code"] == 502
    assert body["message"] == "The sandbox is running but port is not open"
    assert body["sandboxId"] == "dead" and body["port"] == 49983
    assert "refused" in body["detail"]


async def test_control_plane_passthrough(env: Env) -> None:
    async with env.client() as c:
        r = await c.get("/health")
        assert r.json() == {"plane": "control", "path": "/health"}
        r = await c.post("/sandboxes", json={"templateID": "base"})
        assert r.json() == {"plane": "control", "path": "/sandboxes"}
    assert env.control.lifespan == ["startup"]
    async with ws_connect(f"ws://127.0.0.1:{env.proxy_port}/ws", proxy=None) as ws:
        assert await ws.recv() == "control"
