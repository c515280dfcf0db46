"""A sandbox's network rules through the node's lifecycle, on the fake runtime: egress rules in
force from the start, updated live and across pause tiers, inherited by fork's children, put
back after a restart and given to pool sandboxes; private ports that want the sandbox's traffic
token, and fork's children with tokens of their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.domain import ENVD_PORT, CreateRequest, EgressPolicy, SandboxState
from aenv.errors import Forbidden
from tests.node_harness import Harness, build, started


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    async for h in started(tmp_path):
        yield h


# ---------------------------------------------------------------------------- egress rules
CLOSED = EgressPolicy(allow_internet=False, allow_out=["203.0.113.10/32"])


async def test_egress_rules_are_in_force_from_the_start(node: Harness) -> None:
    open_ = await node.orch.sandboxes.create(CreateRequest())
    assert open_.instance is not None and node.runtime.egress(open_.instance) is None
    r = await node.orch.sandboxes.create(CreateRequest(egress=CLOSED))
    assert r.instance is not None
    assert node.runtime.egress(r.instance) == CLOSED
    assert "set_egress" not in node.runtime.ops()  # given with the spec, not afterwards
    assert node.orch.table.get(r.sandbox_id).egress == CLOSED


async def test_update_network_live_and_across_pause_tiers(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    await node.orch.sandboxes.update_network(r.sandbox_id, CLOSED)
    assert r.instance is not None and node.runtime.egress(r.instance) == CLOSED
    await node.orch.pauser.pause(r.sandbox_id)
    frozen = EgressPolicy(deny_out=["0.0.0.0/0"])
    await node.orch.sandboxes.update_network(r.sandbox_id, frozen)
    assert node.runtime.egress(r.instance) == frozen
    await node.orch.pauser.hibernate(r.sandbox_id)
    await node.orch.sandboxes.update_network(
        r.sandbox_id, CLOSED
    )  # nothing running: kept for later
    back, _ = await node.orch.pauser.connect(r.sandbox_id, 60)
    assert back.instance is not None and node.runtime.egress(back.instance) == CLOSED
    await node.orch.snapshotter.snapshot(r.sandbox_id)
    after = node.orch.table.get(r.sandbox_id).instance
    assert after is not None and node.runtime.egress(after) == CLOSED


async def test_fork_children_inherit_egress_rules(node: Harness) -> None:
    parent = await node.orch.sandboxes.create(CreateRequest(egress=CLOSED))
    results = await node.orch.forker.fork(parent.sandbox_id, 2)
    for res in results:
        assert res.sandbox is not None and res.sandbox.instance is not None
        assert res.sandbox.egress == CLOSED
        assert node.runtime.egress(res.sandbox.instance) == CLOSED


async def test_a_restart_puts_domain_rules_back_in_force(tmp_path: Path) -> None:
    """The slot keeps address rules across a server restart, but the proxy that serves domain
    rules is the server's own: recovery applies those policies again (and only those)."""
    names = EgressPolicy(allow_out=["allowed.test"], deny_out=["0.0.0.0/0"])
    h = build(tmp_path)
    await h.orch.start(timers=False)
    by_name = await h.orch.sandboxes.create(CreateRequest(egress=names))
    by_address = await h.orch.sandboxes.create(CreateRequest(egress=CLOSED))
    h2 = await h.restart()
    await h2.orch.start(timers=False)
    try:
        again = [c for c in h2.runtime.calls if c.op == "set_egress"]
        assert [(c.sandbox_id, c.egress) for c in again] == [(by_name.sandbox_id, names)]
        rec = h2.orch.table.get(by_address.sandbox_id)
        assert rec.instance is not None and h2.runtime.egress(rec.instance) == CLOSED
    finally:
        await h2.orch.close()
        h2.catalog.close()


async def test_egress_rules_survive_a_restart(tmp_path: Path) -> None:
    h = build(tmp_path)
    await h.orch.start(timers=False)
    r = await h.orch.sandboxes.create(CreateRequest(egress=CLOSED))
    h2 = await h.restart()
    await h2.orch.start(timers=False)
    try:
        rec = h2.orch.table.get(r.sandbox_id)
        assert rec.egress == CLOSED
        assert rec.instance is not None and h2.runtime.egress(rec.instance) == CLOSED
    finally:
        await h2.orch.close()
        h2.catalog.close()


async def test_pool_sandbox_gets_the_requests_rules(tmp_path: Path) -> None:
    async for h in started(tmp_path, sandbox_pool_size=1):
        for _ in range(200):
            if h.runtime.instances():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        r = await h.orch.sandboxes.create(CreateRequest(egress=CLOSED))
        assert h.runtime.ops().count("create") == 1  # the pool's sandbox was handed out
        assert r.instance is not None and h.runtime.egress(r.instance) == CLOSED


# ---------------------------------------------------------------------------- private traffic
async def test_private_sandbox_ports_want_its_traffic_token(node: Harness) -> None:
    r = await node.orch.sandboxes.create(
        CreateRequest(public_traffic=False, mask_request_host="localhost:${PORT}", auto_resume=True)
    )
    other = await node.orch.sandboxes.create(CreateRequest(public_traffic=False))
    public = await node.orch.sandboxes.create(CreateRequest())
    token = r.traffic_access_token
    assert token and other.traffic_access_token and token != other.traffic_access_token
    assert public.traffic_access_token == ""
    with pytest.raises(Forbidden):
        await node.orch.pauser.resolve(r.sandbox_id, 3000)
    with pytest.raises(Forbidden):
        await node.orch.pauser.resolve(r.sandbox_id, 3000, other.traffic_access_token)
    up = await node.orch.pauser.resolve(r.sandbox_id, 3000, token)
    assert up.host_header == "localhost:3000"
    # envd's port has its own token; a public sandbox wants none.
    assert (await node.orch.pauser.resolve(r.sandbox_id, ENVD_PORT)).port == ENVD_PORT
    assert (await node.orch.pauser.resolve(public.sandbox_id, 3000)).host_header is None
    # A refused request does not wake a paused sandbox.
    await node.orch.pauser.pause(r.sandbox_id)
    with pytest.raises(Forbidden):
        await node.orch.pauser.resolve(r.sandbox_id, 3000)
    assert node.orch.table.get(r.sandbox_id).state is SandboxState.PAUSED


async def test_fork_children_get_their_own_traffic_tokens(node: Harness) -> None:
    parent = await node.orch.sandboxes.create(CreateRequest(public_traffic=False))
    kids = [res.sandbox for res in await node.orch.forker.fork(parent.sandbox_id, 2)]
    tokens = {k.traffic_access_token for k in kids if k is not None}
    assert len(tokens) == 2 and "" not in tokens
    assert parent.traffic_access_token not in tokens
