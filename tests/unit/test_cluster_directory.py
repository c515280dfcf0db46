"""The gateway's directory over a real redis-server: where a sandbox is, and the move of a
hibernated one off a lost or draining node (release on the old node, adopt on another,
the binding rewritten), with the errors a client sees when it cannot move."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from aenv.cluster.directory import Directory, NodeLost
from aenv.cluster.records import NodeRecord, RosterEntry
from aenv.cluster.scheduler import LeastLoaded
from aenv.cluster.state import ClusterState
from aenv.config import Settings
from aenv.errors import BadGateway, NotFound, Unavailable
from tests.helpers import RedisServer, heard_ago, redis_server

DEAD = 60.0  # seconds without a heartbeat before a node counts as lost


def node(node_id: str, *, status: str = "ready") -> NodeRecord:
    return NodeRecord(
        node_id=node_id,
        url=f"http://{node_id}.test",
        status="draining" if status == "draining" else "ready",
        cpu_count=8,
        memory_budget_mb=8192,
    )


async def lost(state: ClusterState, node_id: str, roster: dict[str, RosterEntry]) -> None:
    """Node `node_id` heartbeat with `roster` once, long ago: it counts as lost."""
    await state.heartbeat(node(node_id), roster, None)
    await heard_ago(state, node_id, DEAD * 2)


class Moves:
    """What the directory asked the nodes to do (release / adopt), and their answers."""

    def __init__(self) -> None:
        self.released: list[tuple[str, str]] = []
        self.adopted: list[tuple[str, str, str]] = []
        self.release_answer: str | None = "img-from-release"
        self.unreachable = False
        self.refuse_adopt_on: set[str] = set()
        self.adopt_delay = 0.0

    async def release(self, n: NodeRecord, sandbox_id: str) -> str | None:
        self.released.append((n.node_id, sandbox_id))
        if self.unreachable:
            raise BadGateway(f"node {n.node_id} is unreachable")
        return self.release_answer

    async def adopt(self, n: NodeRecord, sandbox_id: str, image: str) -> None:
        await asyncio.sleep(self.adopt_delay)
        if n.node_id in self.refuse_adopt_on:
            raise Unavailable(f"node {n.node_id} refuses")
        self.adopted.append((n.node_id, sandbox_id, image))


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as srv:
        yield srv


@contextlib.asynccontextmanager
async def directory(srv: RedisServer, home: Path) -> AsyncIterator[tuple[ClusterState, Directory]]:
    state = ClusterState(srv.url, namespace="dir")
    try:
        yield state, Directory(Settings(home=home, node_dead_after=DEAD), state, LeastLoaded())
    finally:
        await state.close()


async def a_drains_b_is_ready(state: ClusterState) -> None:
    """Node a draining with the paused sandbox s1, node b ready and empty."""
    await state.heartbeat(node("a", status="draining"), {"s1": RosterEntry(state="paused")}, None)
    await state.heartbeat(node("b"), {}, None)


async def test_a_sandbox_on_a_healthy_node_is_routed_there(
    redis: RedisServer, tmp_path: Path
) -> None:
    async with directory(redis, tmp_path) as (state, d):
        await state.heartbeat(node("a"), {"s1": RosterEntry(state="running")}, None)
        moves = Moves()
        assert (await d.usable("s1", moves.release, moves.adopt, resume=False)).node_id == "a"
        assert (await d.locate("s1")).node_id == "a"
        assert moves.released == [] and moves.adopted == []
        with pytest.raises(NotFound, match="s-unknown"):
            await d.locate("s-unknown")


async def test_a_hibernated_sandbox_moves_off_a_lost_node(
    redis: RedisServer, tmp_path: Path
) -> None:
    async with directory(redis, tmp_path) as (state, d):
        entry = RosterEntry(state="paused", tier="hibernated", image="img-s1", template_id="base")
        await lost(state, "a", {"s1": entry})
        await state.heartbeat(node("b"), {}, None)
        moves = Moves()
        target = await d.usable("s1", moves.release, moves.adopt, resume=True)
        assert target.node_id == "b"
        # A lost node is not asked: the image its roster named is adopted elsewhere.
        assert moves.released == [] and moves.adopted == [("b", "s1", "img-s1")]
        assert await state.binding("s1") == "b"


async def test_a_running_sandbox_on_a_lost_node_is_a_clear_502(
    redis: RedisServer, tmp_path: Path
) -> None:
    async with directory(redis, tmp_path) as (state, d):
        await lost(state, "a", {"s1": RosterEntry(state="running")})
        await state.heartbeat(node("b"), {}, None)
        moves = Moves()
        with pytest.raises(NodeLost) as err:
            await d.usable("s1", moves.release, moves.adopt, resume=False)
        assert err.value.status == 502 and err.value.to_json()["sandboxId"] == "s1"
        assert "unreachable" in str(err.value) and moves.adopted == []
        ago = re.search(r"no heartbeat for (\d+) s", str(err.value))
        assert ago is not None and int(ago.group(1)) >= DEAD * 2


async def test_nowhere_to_move_is_503(redis: RedisServer, tmp_path: Path) -> None:
    async with directory(redis, tmp_path) as (state, d):
        entry = RosterEntry(state="paused", image="img-s1")
        await lost(state, "a", {"s1": entry})
        await state.heartbeat(node("b", status="draining"), {}, None)  # not schedulable
        moves = Moves()
        with pytest.raises(Unavailable, match="no other node"):
            await d.usable("s1", moves.release, moves.adopt, resume=True)


async def test_a_resume_on_a_draining_node_moves_what_the_node_releases(
    redis: RedisServer, tmp_path: Path
) -> None:
    async with directory(redis, tmp_path) as (state, d):
        await a_drains_b_is_ready(state)
        moves = Moves()
        # A request that does not resume it stays where it is.
        assert (await d.usable("s1", moves.release, moves.adopt, resume=False)).node_id == "a"
        assert moves.released == []
        target = await d.usable("s1", moves.release, moves.adopt, resume=True)
        assert target.node_id == "b"
        assert moves.released == [("a", "s1")]
        assert moves.adopted == [("b", "s1", "img-from-release")]
        assert await state.binding("s1") == "b"


async def test_a_draining_node_that_cannot_release_keeps_the_sandbox(
    redis: RedisServer, tmp_path: Path
) -> None:
    async with directory(redis, tmp_path) as (state, d):
        await a_drains_b_is_ready(state)
        moves = Moves()
        moves.release_answer = None  # e.g. frozen in memory: it resumes where it is
        assert (await d.usable("s1", moves.release, moves.adopt, resume=True)).node_id == "a"
        assert moves.adopted == [] and await state.binding("s1") == "a"


async def test_a_failed_adopt_gives_the_sandbox_back_to_its_draining_node(
    redis: RedisServer, tmp_path: Path
) -> None:
    async with directory(redis, tmp_path) as (state, d):
        await a_drains_b_is_ready(state)
        moves = Moves()
        moves.refuse_adopt_on = {"b"}
        with pytest.raises(Unavailable, match="refuses"):
            await d.usable("s1", moves.release, moves.adopt, resume=True)
        # Released, refused by b, taken back by a: not lost.
        assert moves.adopted == [("a", "s1", "img-from-release")]
        assert await state.binding("s1") == "a"


async def test_concurrent_requests_move_a_sandbox_once(redis: RedisServer, tmp_path: Path) -> None:
    async with directory(redis, tmp_path) as (state, d):
        entry = RosterEntry(state="paused", image="img-s1")
        await lost(state, "a", {"s1": entry})
        await state.heartbeat(node("b"), {}, None)
        moves = Moves()
        moves.adopt_delay = 0.1
        targets = await asyncio.gather(
            *(d.usable("s1", moves.release, moves.adopt, resume=True) for _ in range(5))
        )
        assert {t.node_id for t in targets} == {"b"}
        assert moves.adopted == [("b", "s1", "img-s1")]


@pytest.mark.parametrize("movable", [True, False])
async def test_a_node_gone_after_its_drain_is_taken_at_its_roster(
    redis: RedisServer, tmp_path: Path, movable: bool
) -> None:
    """A node stopped (drained at SIGTERM) before its heartbeats ran out: the release finds
    no one; what its last heartbeat said went into the repository moves, the rest is 502."""
    async with directory(redis, tmp_path) as (state, d):
        entry = (
            RosterEntry(state="paused", tier="hibernated", image="img-s1", template_id="base")
            if movable
            else RosterEntry(state="running")
        )
        await state.heartbeat(node("a", status="draining"), {"s1": entry}, None)
        await state.heartbeat(node("b"), {}, None)
        moves = Moves()
        moves.unreachable = True
        if not movable:
            with pytest.raises(BadGateway, match="unreachable"):
                await d.usable("s1", moves.release, moves.adopt, resume=True)
            assert moves.adopted == []
            return
        target = await d.usable("s1", moves.release, moves.adopt, resume=True)
        assert target.node_id == "b" and moves.released == [("a", "s1")]
        assert moves.adopted == [("b", "s1", "img-s1")]
        assert await state.binding("s1") == "b"
