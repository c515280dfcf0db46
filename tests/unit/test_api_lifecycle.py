"""The calls on a sandbox through the API over a real orchestrator on the fake runtime:
kill, timeouts, pause, connect and resume, its network rules; and the real e2b SDK against
the node served by uvicorn."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.domain import EgressPolicy, PauseTier
from aenv.domain import SandboxState as State
from aenv.runtime.fake import FakeState
from tests.node_harness import Harness, build
from tests.unit.api_node import API_KEY, assert_error, running, served


async def test_kill(client: httpx.AsyncClient, node: Harness) -> None:
    rec = await running(node)
    inst = rec.instance
    assert inst is not None
    r = await client.delete(f"/sandboxes/{rec.sandbox_id}")
    assert r.status_code == 204 and r.content == b""
    assert node.runtime.state(inst) is FakeState.GONE
    assert_error(await client.get(f"/sandboxes/{rec.sandbox_id}"), 404)
    assert_error(await client.delete(f"/sandboxes/{rec.sandbox_id}"), 404)


async def test_timeout_and_refresh(client: httpx.AsyncClient, node: Harness) -> None:
    sid = (await running(node)).sandbox_id
    t0 = node.clock.now

    async def end_at() -> timedelta:
        """The sandbox's end as the API shows it, from t0."""
        body = (await client.get(f"/sandboxes/{sid}")).json()
        return datetime.fromisoformat(body["endAt"]) - t0

    r = await client.post(f"/sandboxes/{sid}/timeout", json={"timeout": 120})
    assert r.status_code == 204
    assert await end_at() == timedelta(seconds=120)
    assert_error(await client.post(f"/sandboxes/{sid}/timeout", json={}), 400)
    assert_error(await client.post(f"/sandboxes/{sid}/timeout", json={"timeout": 86401}), 400)
    assert await end_at() == timedelta(seconds=120)
    r = await client.post(f"/sandboxes/{sid}/refreshes", json={"duration": 300})
    assert r.status_code == 204
    assert await end_at() == timedelta(seconds=300)
    # Without a body: the default timeout (300 s) from now; a refresh never shortens.
    node.clock.advance(100)
    assert (await client.post(f"/sandboxes/{sid}/refreshes")).status_code == 204
    assert await end_at() == timedelta(seconds=100 + node.settings.default_timeout)
    r = await client.post(f"/sandboxes/{sid}/refreshes", json={"duration": 10})
    assert r.status_code == 204
    assert await end_at() == timedelta(seconds=100 + node.settings.default_timeout)
    assert_error(await client.post(f"/sandboxes/{sid}/refreshes", json={"duration": 3601}), 400)


async def test_pause_connect_resume(client: httpx.AsyncClient, node: Harness) -> None:
    rec = await running(node)
    sid = rec.sandbox_id

    def container() -> FakeState:
        return FakeState.GONE if rec.instance is None else node.runtime.state(rec.instance)

    def ends_in(seconds: int) -> bool:
        return rec.end_at == node.clock.now + timedelta(seconds=seconds)

    # v1 connect on a running sandbox: 200, its timeout extended; v1 needs a timeout.
    r = await client.post(f"/sandboxes/{sid}/connect", json={"timeout": 600})
    assert r.status_code == 200 and r.json()["sandboxID"] == sid and ends_in(600)
    assert_error(await client.post(f"/sandboxes/{sid}/connect", json={}), 400)
    # resume on a running sandbox: 409, and it must not touch the sandbox.
    calls = len(node.runtime.calls)
    assert_error(await client.post(f"/sandboxes/{sid}/resume", json={}), 409)
    assert len(node.runtime.calls) == calls and ends_in(600)

    # pause keeps the memory by default: the container is frozen.
    r = await client.post(f"/sandboxes/{sid}/pause", json={})
    assert r.status_code == 204 and r.content == b""
    assert rec.paused is not None and rec.paused.tier is PauseTier.FROZEN
    assert container() is FakeState.FROZEN
    assert_error(await client.post(f"/sandboxes/{sid}/pause"), 409)
    assert (await client.get(f"/sandboxes/{sid}")).json()["state"] == "paused"

    # v2 connect resumes (thawed, the default timeout from now): 201; empty body and no
    # body both work.
    r = await client.post(f"/v2/sandboxes/{sid}/connect", json={})
    assert r.status_code == 201
    assert r.json() == {
        "sandboxID": sid,
        "templateID": "base",
        "clientID": "aenv",
        "envdVersion": "0.6.4",
        "alias": "base",
        "envdAccessToken": rec.envd_access_token,
        "trafficAccessToken": None,
        "domain": None,
    }
    assert container() is FakeState.RUNNING and ends_in(node.settings.default_timeout)
    r = await client.post(f"/v2/sandboxes/{sid}/connect")
    assert r.status_code == 200

    # A strict pause is refused while the guest's envd does not answer; the sandbox runs on.
    assert rec.instance is not None
    node.envd.unhealthy.add(rec.instance.address)
    body = {"memory": False, "requireHealthyGuest": True}
    r = await client.post(f"/sandboxes/{sid}/pause", json=body)
    assert "envd" in assert_error(r, 503)["message"]
    assert rec.state is State.RUNNING and container() is FakeState.RUNNING
    node.envd.unhealthy.clear()
    # Files only: the container is gone.
    old = rec.instance
    r = await client.post(f"/sandboxes/{sid}/pause", json=body)
    assert r.status_code == 204
    assert rec.paused is not None and rec.paused.tier is PauseTier.FILES
    assert node.runtime.state(old) is FakeState.GONE
    # resume boots it afresh on its files, for the given timeout.
    r = await client.post(f"/sandboxes/{sid}/resume", json={"timeout": 30, "autoPause": True})
    assert r.status_code == 201 and r.json()["sandboxID"] == sid
    assert rec.state is State.RUNNING and container() is FakeState.RUNNING and ends_in(30)
    assert rec.instance is not None and rec.instance.id != old.id

    # v1 connect with `memory: false` on a paused sandbox drops its memory: a fresh boot.
    await node.orch.pauser.pause(sid)
    frozen = rec.instance
    assert frozen is not None and container() is FakeState.FROZEN
    r = await client.post(f"/sandboxes/{sid}/connect", json={"timeout": 60, "memory": False})
    assert r.status_code == 201
    assert node.runtime.state(frozen) is FakeState.GONE and container() is FakeState.RUNNING
    assert ends_in(60)
    assert_error(await client.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": -5}), 400)


async def test_update_network_replaces_rules_and_shows_them(
    client: httpx.AsyncClient, node: Harness
) -> None:
    sbx = await running(node)
    assert sbx.instance is not None
    r = await client.put(
        f"/sandboxes/{sbx.sandbox_id}/network",
        json={"allowOut": ["198.51.100.0/24"], "denyOut": ["0.0.0.0/0"]},
    )
    assert r.status_code == 204, r.text
    want = EgressPolicy(allow_out=["198.51.100.0/24"], deny_out=["0.0.0.0/0"])
    assert node.runtime.egress(sbx.instance) == want  # in force at once
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
    assert node.runtime.egress(sbx.instance) == EgressPolicy(allow_internet=False)
    assert (await client.get(f"/sandboxes/{sbx.sandbox_id}")).json()["allowInternetAccess"] is False
    assert_error(await client.put("/sandboxes/nope/network", json={}), 404)
    assert_error(
        await client.put(f"/sandboxes/{sbx.sandbox_id}/network", json={"allowOut": "x"}), 400
    )
    assert node.runtime.egress(sbx.instance) == EgressPolicy(allow_internet=False)


async def test_update_network_takes_domain_rules_and_no_dns_servers(
    client: httpx.AsyncClient, node: Harness
) -> None:
    sbx = await running(node)
    assert sbx.instance is not None
    r = await client.put(
        f"/sandboxes/{sbx.sandbox_id}/network",
        json={"allowOut": ["api.example.com"], "denyOut": ["*.example.com"], "dnsServers": []},
    )
    assert r.status_code == 204, r.text
    in_force = node.runtime.egress(sbx.instance)
    assert in_force is not None and in_force.dns_servers == []  # none, not the default
    info = (await client.get(f"/sandboxes/{sbx.sandbox_id}")).json()
    assert info["network"]["allowOut"] == ["api.example.com"]
    assert info["network"]["denyOut"] == ["*.example.com"]
    assert info["network"]["dnsServers"] == []


# --------------------------------------------------------------------------------------------
# the real e2b SDK against the node served by uvicorn


@pytest.fixture
def served_node(tmp_path: Path) -> Iterator[tuple[str, Harness]]:
    h = build(tmp_path, api_key=API_KEY)
    with served(h, lifespan="on") as url:
        yield url, h


def test_e2b_sdk_parses_our_responses(served_node: tuple[str, Harness]) -> None:
    from e2b import Sandbox, SandboxQuery, SandboxState

    url, h = served_node
    opts: dict[str, Any] = {"api_key": API_KEY, "api_url": url, "sandbox_url": url}
    with httpx.Client(base_url=url, headers={"X-API-Key": API_KEY}) as api:

        def create(**body: Any) -> str:
            r = api.post("/v2/sandboxes", json={"templateID": "base", **body})
            assert r.status_code == 201, r.text
            return str(r.json()["sandboxID"])

        group = [create(metadata={"suite": "sdk", "n": str(i)}) for i in range(3)]
        paused = create(metadata={"suite": "sdk-paused"}, autoPause=True)
        assert api.post(f"/sandboxes/{paused}/pause").status_code == 204

    # Pagination through the SDK's paginator (limit=1, x-next-token).
    paginator = Sandbox.list(query=SandboxQuery(metadata={"suite": "sdk"}), limit=1, **opts)
    seen = []
    while paginator.has_next:
        items = paginator.next_items()
        assert len(items) <= 1
        seen += [i.sandbox_id for i in items]
    assert sorted(seen) == sorted(group)

    items = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED]), **opts).next_items()
    assert [i.sandbox_id for i in items] == [paused]
    assert items[0].state == SandboxState.PAUSED
    assert items[0].metadata == {"suite": "sdk-paused"}

    info = Sandbox.get_info(group[0], **opts)
    assert info.sandbox_id == group[0]
    assert info.template_id == "base" and info.name == "base"
    assert info.state == SandboxState.RUNNING
    assert info.metadata == {"suite": "sdk", "n": "0"}
    assert info.started_at == h.clock.now  # the node's clock when it made the sandbox
    assert info.cpu_count == 2 and info.memory_mb == 512
    assert info.lifecycle == {"on_timeout": "kill", "auto_resume": False}
    assert info.sandbox_domain is None
    assert Sandbox.get_info(paused, **opts).lifecycle == {
        "on_timeout": "pause",
        "auto_resume": False,
    }

    Sandbox.set_timeout(group[0], 120, **opts)
    assert h.orch.table.get(group[0]).end_at == h.clock.now + timedelta(seconds=120)
    assert Sandbox.pause(group[1], **opts) is True
    assert Sandbox.pause(group[1], **opts) is False  # 409: already paused

    assert Sandbox.kill(group[0], **opts) is True
    assert Sandbox.kill(group[0], **opts) is False
    assert Sandbox.kill("does-not-exist", **opts) is False

    from e2b.exceptions import AuthenticationException, SandboxNotFoundException

    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info("does-not-exist", **opts)
    with pytest.raises(AuthenticationException):
        Sandbox.get_info(group[1], **{**opts, "api_key": "wrong"})


def test_e2b_sdk_create_and_connect(served_node: tuple[str, Harness]) -> None:
    from e2b import Sandbox

    url, h = served_node
    opts: dict[str, Any] = {"api_key": API_KEY, "api_url": url, "sandbox_url": url}
    sbx = Sandbox.create(
        template="base", timeout=60, metadata={"k": "v"}, idempotency_key="abc-1", **opts
    )
    rec = h.orch.table.get(sbx.sandbox_id)
    assert rec.metadata == {"k": "v"} and rec.end_at == h.clock.now + timedelta(seconds=60)
    again = Sandbox.create(template="base", timeout=60, idempotency_key="abc-1", **opts)
    assert again.sandbox_id == sbx.sandbox_id
    assert [r.sandbox_id for r in h.orch.table.list()] == [sbx.sandbox_id]
    assert Sandbox.pause(sbx.sandbox_id, **opts) is True
    assert rec.state is State.PAUSED
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=90, **opts)
    assert resumed.sandbox_id == sbx.sandbox_id
    assert rec.state is State.RUNNING and rec.end_at == h.clock.now + timedelta(seconds=90)
