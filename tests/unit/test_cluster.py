"""The cluster's pieces that need no sandbox: the node network a node id picks, merged
paging across nodes, the default scheduler, and the Redis state against a real
redis-server (heartbeats, bindings rebuilt after Redis lost everything)."""

from __future__ import annotations

import contextlib
import ipaddress
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from aenv.api.listing import Cursor
from aenv.cluster.aggregate import merge_pages
from aenv.cluster.records import NodeRecord, RosterEntry
from aenv.cluster.scheduler import LeastLoaded, Placement, load_scheduler
from aenv.cluster.state import ClusterState
from aenv.config import Settings
from aenv.errors import Unavailable
from aenv.nodenet import node_network
from aenv.runtime.net.network import SlotAddressing
from tests.helpers import RedisServer, heard_ago, redis_server

# ----------------------------------------------------------------------------- node network


def test_node_ids_pick_distinct_usable_networks() -> None:
    ids = [f"node-{i}" for i in range(12)]
    nets = [node_network(i) for i in ids]
    assert len({p for p, _ in nets}) == len(ids)
    cidrs = [ipaddress.IPv4Network(c) for _, c in nets]
    assert all(not a.overlaps(b) for i, a in enumerate(cidrs) for b in cidrs[i + 1 :])
    for prefix, cidr in nets:
        SlotAddressing(prefix, cidr)  # valid names for every slot of the range
        assert not ipaddress.IPv4Network(cidr).overlaps(ipaddress.IPv4Network("10.200.0.0/16"))
    assert node_network("node-1") == node_network("node-1")  # stable across restarts


def test_explicit_network_settings_win_over_the_node_id() -> None:
    derived = Settings(node_id="n1")
    assert (derived.net_prefix, derived.net_cidr) == node_network("n1")
    own = Settings(node_id="n1", net_prefix="mine", net_cidr="10.9.0.0/16")
    assert (own.net_prefix, own.net_cidr) == ("mine", "10.9.0.0/16")
    single = Settings()
    assert (single.net_prefix, single.net_cidr) == ("aenv", "10.200.0.0/16")


# ----------------------------------------------------------------------------- paging


def _item(i: int, node: str) -> dict[str, Any]:
    at = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=i)
    return {"sandboxID": f"s{i:02d}-{node}", "startedAt": at.isoformat()}


def test_merged_pages_walk_every_item_once_in_order() -> None:
    nodes = {n: [_item(i, n) for i in range(k, 30, 3)] for k, n in enumerate("abc")}
    seen: list[str] = []
    cursor: Cursor | None = None
    for _ in range(40):
        pages = []
        for items in nodes.values():
            after = [
                x
                for x in items
                if cursor is None
                or (datetime.fromisoformat(x["startedAt"]), x["sandboxID"])
                > (cursor.started_at, cursor.sandbox_id)
            ]
            pages.append((after[:4], len(after) > 4))  # each node's own page of 4
        page, token = merge_pages(
            pages, time_field="startedAt", id_field="sandboxID", desc=False, limit=4
        )
        seen += [x["sandboxID"] for x in page]
        if token is None:
            break
        cursor = Cursor.decode(token)
    everything = sorted((x for xs in nodes.values() for x in xs), key=lambda x: x["startedAt"])
    assert seen == [x["sandboxID"] for x in everything]


def test_merged_listing_lists_a_shared_template_once() -> None:
    t = {"templateID": "base", "createdAt": "2026-01-01T00:00:00Z"}
    page, token = merge_pages(
        [([t], False), ([dict(t)], False)],
        time_field="createdAt",
        id_field="templateID",
        desc=False,
        limit=None,
    )
    assert page == [t] and token is None


# ----------------------------------------------------------------------------- scheduler


def _node(nid: str, free_mb: int, **kw: Any) -> NodeRecord:
    return NodeRecord(node_id=nid, url=f"http://{nid}", memory_budget_mb=free_mb, cpu_count=8, **kw)


def test_a_burst_of_creates_spreads_over_nodes() -> None:
    s = LeastLoaded()
    nodes = [_node("a", 4096), _node("b", 4096), _node("c", 4096)]
    placed = [s.place(Placement("base", 2, 512), nodes).node_id for _ in range(6)]
    assert sorted(placed) == ["a", "a", "b", "b", "c", "c"]


def test_layers_on_a_node_win_unless_it_is_far_fuller() -> None:
    req = Placement("tpl", 1, 256)
    near = _node("a", 3000, templates=["tpl"])
    assert LeastLoaded().place(req, [near, _node("b", 4000)]).node_id == "a"
    assert (
        LeastLoaded().place(req, [_node("a", 1000, templates=["tpl"]), _node("b", 4000)]).node_id
        == "b"
    )


def test_no_node_is_a_clear_error_and_policies_plug_in() -> None:
    with pytest.raises(Unavailable, match="no node is ready"):
        LeastLoaded().place(Placement("base", 1, 1), [])
    assert isinstance(load_scheduler("aenv.cluster.scheduler:LeastLoaded"), LeastLoaded)
    with pytest.raises(ValueError, match="module:attribute"):
        load_scheduler("fastest")


# ----------------------------------------------------------------------------- Redis state


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as srv:
        yield srv


@contextlib.asynccontextmanager
async def cluster_state(srv: RedisServer) -> AsyncIterator[ClusterState]:
    st = ClusterState(srv.url, namespace="t")
    try:
        yield st
    finally:
        await st.close()


async def test_heartbeats_register_nodes_and_bind_their_sandboxes(redis: RedisServer) -> None:
    async with cluster_state(redis) as st:
        n1 = _node("n1", 2048)
        prev = await st.heartbeat(n1, {"s1": RosterEntry(state="running")}, None)
        nodes = await st.nodes(dead_after=10)
        assert [n.node_id for n in nodes] == ["n1"] and nodes[0].healthy
        assert await st.binding("s1") == "n1"
        # s1 gone, s2 new: its binding comes, s1's goes
        await st.heartbeat(n1, {"s2": RosterEntry(state="paused", image="hib-s2-x")}, prev)
        assert await st.binding("s1") is None and await st.binding("s2") == "n1"
        entry = await st.roster_entry("n1", "s2")
        assert entry is not None and entry.movable
        # a node that stops heartbeating turns unhealthy
        await st.heartbeat(_node("n2", 1024), {}, None)
        await heard_ago(st, "n2", 30)
        health = {n.node_id: n.healthy for n in await st.nodes(dead_after=10)}
        assert health == {"n1": True, "n2": False}


async def test_health_does_not_need_the_nodes_clock_to_agree(redis: RedisServer) -> None:
    """Liveness is when Redis took the heartbeat, by Redis's clock: a node whose clock is
    ten minutes slow (or fast) is healthy while it heartbeats."""
    async with cluster_state(redis) as st:
        for nid, skew in (("slow", -600.0), ("fast", 600.0)):
            own = time.time() + skew
            await st.heartbeat(_node(nid, 1024, heartbeat_at=own, started_at=own), {}, None)
        nodes = {n.node_id: n for n in await st.nodes(dead_after=6)}
        assert {nid: n.healthy for nid, n in nodes.items()} == {"fast": True, "slow": True}
        assert all(n.seen_ago < 6 for n in nodes.values())


def test_a_newer_heartbeat_takes_in_the_creates_placed_before_it() -> None:
    s = LeastLoaded()
    a, b = _node("a", 4096, seen_at=100.0), _node("b", 3072, seen_at=100.0)
    # a has more room, so it takes the first two; then they count against it until ...
    assert [s.place(Placement("base", 1, 1024), [a, b]).node_id for _ in range(2)] == ["a", "b"]
    # ... a heartbeat newer than those placements reports a's figures with them included.
    a2 = _node("a", 4096, seen_at=101.0, allocated_memory_mb=1024)
    assert s.place(Placement("base", 1, 1024), [a2, b]).node_id == "a"


async def test_a_binding_that_moved_is_not_removed_by_the_old_node(redis: RedisServer) -> None:
    async with cluster_state(redis) as st:
        prev = await st.heartbeat(_node("a", 1), {"s": RosterEntry(state="paused")}, None)
        await st.bind("s", "b")  # a gateway moved it to node b
        await st.heartbeat(_node("a", 1), {}, prev)
        assert await st.binding("s") == "b"


async def test_bindings_come_back_after_redis_loses_everything(redis: RedisServer) -> None:
    async with cluster_state(redis) as st:
        srv = redis
        roster = {f"s{i}": RosterEntry(state="running") for i in range(50)}
        prev = await st.heartbeat(_node("n1", 1), roster, None)
        srv.stop()
        srv.start()  # empty: no persistence
        assert await st.binding("s7") is None
        # the node's next heartbeat finds its registration gone and writes every binding
        await st.heartbeat(_node("n1", 1), roster, prev)
        assert all([await st.binding(s) == "n1" for s in roster])
        # and a binding lost some other way is found in the rosters
        await st.unbind("s9")
        assert await st.find("s9", ["n0", "n1"]) == "n1"
        assert await st.binding("s9") == "n1"
