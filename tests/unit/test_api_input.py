"""Input the API once accepted and that then broke a sandbox (or every later list) is refused
with a 400 in E2B's error shape, before the node (a real orchestrator on the fake runtime)
makes or touches a sandbox."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from aenv.api.inputs import (
    MAX_METADATA_KEYS,
    MAX_METADATA_TOTAL_BYTES,
    MAX_METADATA_VALUE_BYTES,
)
from aenv.domain import SandboxState as State
from aenv.envd.envrules import MAX_ENV_TOTAL_BYTES, MAX_ENV_VALUE_BYTES, env_problem
from tests.node_harness import Harness
from tests.unit.api_node import assert_error, assert_nothing_created, running

CREATE_PATHS = ("/sandboxes", "/v2/sandboxes", "/sandboxes-cold")


def _create_body(path: str, **fields: Any) -> dict[str, Any]:
    base = {"image": "docker.io/library/alpine:3"} if path == "/sandboxes-cold" else {}
    return {"templateID": "base", **base, **fields}


BAD_ENV: list[tuple[dict[str, Any], str]] = [
    ({"A=B": "x"}, "'='"),
    ({"A\0B": "x"}, "NUL"),
    ({"": "x"}, "empty"),
    ({"A": "x\0y"}, "NUL"),
    ({"BIG": "x" * (MAX_ENV_VALUE_BYTES + 1)}, str(MAX_ENV_VALUE_BYTES)),
    ({f"V{i}": "x" * 30_000 for i in range(10)}, str(MAX_ENV_TOTAL_BYTES)),
    ({"A": 1}, "envVars"),
    ({"A": None}, "envVars"),
]


@pytest.mark.parametrize("path", CREATE_PATHS)
@pytest.mark.parametrize("env, needle", BAD_ENV)
async def test_create_refuses_env_vars_no_process_could_have(
    client: httpx.AsyncClient,
    node: Harness,
    path: str,
    env: dict[str, Any],
    needle: str,
) -> None:
    err = assert_error(await client.post(path, json=_create_body(path, envVars=env)), 400)
    assert "envVars" in err["message"] and needle in err["message"]
    assert_nothing_created(node)


BAD_METADATA: list[tuple[Any, str]] = [
    ({"k": "x" * (50 << 20 >> 6)}, str(MAX_METADATA_VALUE_BYTES)),
    ({f"k{i}": "v" for i in range(MAX_METADATA_KEYS + 1)}, str(MAX_METADATA_KEYS)),
    (
        {f"k{i}": "v" * (MAX_METADATA_VALUE_BYTES - 8) for i in range(20)},
        str(MAX_METADATA_TOTAL_BYTES),
    ),
    ({"": "v"}, "empty"),
    ({"k": "a\0b"}, "NUL"),
    ({"k" * 300: "v"}, "256"),
    ({"k": ["v"]}, "metadata"),
    (["k", "v"], "metadata"),
]


@pytest.mark.parametrize("path", CREATE_PATHS)
@pytest.mark.parametrize("metadata, needle", BAD_METADATA)
async def test_create_refuses_oversized_or_malformed_metadata(
    client: httpx.AsyncClient,
    node: Harness,
    path: str,
    metadata: Any,
    needle: str,
) -> None:
    err = assert_error(await client.post(path, json=_create_body(path, metadata=metadata)), 400)
    assert "metadata" in err["message"] and needle in err["message"]
    assert_nothing_created(node)


async def test_create_takes_env_and_metadata_at_the_bounds(
    client: httpx.AsyncClient, node: Harness
) -> None:
    env = {"PATHLIKE": "/x:" * 100, "EMPTY": "", "BIG": "y" * MAX_ENV_VALUE_BYTES, "ü": "ß"}
    metadata = {f"k{i}": "v" * 900 for i in range(MAX_METADATA_KEYS)}
    r = await client.post(
        "/v2/sandboxes", json={"templateID": "base", "envVars": env, "metadata": metadata}
    )
    assert r.status_code == 201, r.text
    rec = node.orch.table.get(r.json()["sandboxID"])
    assert (rec.env_vars, rec.metadata) == (env, metadata)
    (_, init), *_ = node.envd.inits  # what envd was given for the sandbox's processes
    assert init["env_vars"] == {"LANG": "C.UTF-8", **env}
    listed = (await client.get("/v2/sandboxes")).json()
    assert listed[0]["metadata"] == metadata


@pytest.mark.parametrize(
    "field, value",
    [
        ("timeout", "10"),
        ("timeout", 10.5),
        ("timeout", True),
        ("secure", "yes"),
        ("autoPause", 1),
        ("allow_internet_access", "false"),
        ("templateID", 7),
        ("cpuCount", "2"),
        ("autoResume", {"enabled": "true"}),
        ("network", {"allowPublicTraffic": "no"}),
        ("network", {"allowOut": "1.2.3.4"}),
        ("network", "open"),
    ],
)
async def test_create_refuses_wrong_types(
    client: httpx.AsyncClient, node: Harness, field: str, value: Any
) -> None:
    # `secure` is v1's alone (v2 ignores it, as unknown fields).
    for path in ("/sandboxes",) if field == "secure" else ("/sandboxes", "/v2/sandboxes"):
        body = {"templateID": "base", field: value}
        err = assert_error(await client.post(path, json=body), 400)
        assert field in err["message"]
    assert_nothing_created(node)


@pytest.mark.parametrize(
    "path, body, needle",
    [
        ("/sandboxes/{id}/connect", {"timeout": "60"}, "timeout"),
        ("/sandboxes/{id}/connect", {"timeout": 60, "memory": "no"}, "memory"),
        ("/sandboxes/{id}/connect", {"timeout": -1}, "timeout"),
        ("/sandboxes/{id}/connect", [60], "body"),
        ("/v2/sandboxes/{id}/connect", {"timeout": "60"}, "timeout"),
        ("/v2/sandboxes/{id}/connect", {"timeout": 10**12}, "timeout"),
        ("/v2/sandboxes/{id}/connect", {"memory": 0}, "memory"),
        ("/v2/sandboxes/{id}/connect", "60", "body"),
        ("/sandboxes/{id}/resume", {"timeout": "60"}, "timeout"),
        ("/sandboxes/{id}/resume", {"autoPause": "yes"}, "autoPause"),
        ("/sandboxes/{id}/timeout", {"timeout": "60"}, "timeout"),
        ("/sandboxes/{id}/refreshes", {"duration": "60"}, "duration"),
        ("/sandboxes/{id}/pause", {"memory": "false"}, "memory"),
    ],
)
async def test_lifecycle_bodies_refuse_wrong_types(
    client: httpx.AsyncClient, node: Harness, path: str, body: Any, needle: str
) -> None:
    rec = await running(node)
    end_at, calls = rec.end_at, len(node.runtime.calls)
    r = await client.post(path.format(id=rec.sandbox_id), json=body)
    assert needle in assert_error(r, 400)["message"]
    # Nothing reached the sandbox: still running, its timeout as it was, the runtime not
    # called.
    assert (rec.state, rec.end_at, len(node.runtime.calls)) == (State.RUNNING, end_at, calls)


async def test_a_mebibyte_env_value_is_refused_before_it_is_read(
    client: httpx.AsyncClient, node: Harness
) -> None:
    body = {"templateID": "base", "envVars": {"BIG": "x" * (1 << 20)}}
    assert_error(await client.post("/v2/sandboxes", json=body), 413)
    assert_nothing_created(node)


def test_env_rules_accept_what_a_shell_takes() -> None:
    assert env_problem({"A": "", "_x1": "v", "LANG": "C.UTF-8", "ü": "ß"}) is None
    assert env_problem({}) is None


@pytest.mark.parametrize("value", ["0.5", "1700000000", "2025-01-01", "yesterday"])
async def test_started_after_must_be_a_date_time(client: httpx.AsyncClient, value: str) -> None:
    r = await client.get("/v2/sandboxes", params={"startedAfter": value})
    assert "startedAfter" in assert_error(r, 400)["message"]
    r = await client.get("/v2/sandboxes", params={"startedAfter": "2025-01-01T00:00:00Z"})
    assert r.status_code == 200


async def test_openapi_declares_what_the_api_answers(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            # Any body can be refused as too large; a parameter is never sent as JSON null.
            if "requestBody" in op:
                assert "413" in op["responses"], (method, path)
            assert "422" not in op["responses"]
            for param in op.get("parameters", []):
                assert {"type": "null"} not in param["schema"].get("anyOf", []), (path, param)
    create = doc["components"]["schemas"]["NewSandboxV2"]["properties"]
    assert any(o.get("maxProperties") == MAX_METADATA_KEYS for o in create["metadata"]["anyOf"])
