"""Standby on disk on the whole orchestrator over the fake runtime: a sandbox in standby long
enough is hibernated and still running to its user; its next request restores it with its
timeout unchanged; its timeout still ends it; a pause or a kill leaves it on disk; a create
the memory budget cannot hold sends the sandboxes in standby idle longest to disk first; a
template's setting applies to its sandboxes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.domain import ENVD_PORT, CreateRequest, PauseTier, SandboxRecord, SandboxState
from aenv.errors import Unavailable
from aenv.runtime.fake import FakeState
from tests.node_harness import Harness, started


async def idle_for(h: Harness, seconds: float) -> None:
    for _ in range(int(seconds // 5)):
        h.clock.advance(5)
        await h.orch.sampler.round()
        await h.orch.context.join()


def short_of_memory(tmp_path: Path, budget_mb: int) -> AsyncIterator[Harness]:
    """A node of `budget_mb` without a warm pool, whose sandboxes go to standby soon and to
    disk only when memory is short."""
    return started(
        tmp_path,
        nap_after=5.0,
        standby_after=5.0,
        standby_disk_after=0.0,
        max_memory_mb=budget_mb,
        sandbox_pool_size=0,
    )


def on_disk(h: Harness, r: SandboxRecord) -> bool:
    rec = h.orch.table.get(r.sandbox_id)
    return rec.instance is None and rec.tier is PauseTier.HIBERNATED


def frozen(h: Harness, r: SandboxRecord) -> bool:
    rec = h.orch.table.get(r.sandbox_id)
    return rec.instance is not None and h.runtime.state(rec.instance) is FakeState.FROZEN


async def test_a_sandbox_long_in_standby_goes_to_disk_and_its_next_request_restores_it(
    tmp_path: Path,
) -> None:
    async for h in started(tmp_path, nap_after=10.0, standby_after=20.0, standby_disk_after=60.0):
        r = await h.orch.sandboxes.create(CreateRequest())
        await idle_for(h, 40)
        assert frozen(h, r) and not on_disk(h, r)
        await idle_for(h, 60)
        assert on_disk(h, r)
        # Running to its user: shown, listed and counted as running, timeout unchanged.
        rec = h.orch.table.get(r.sandbox_id)
        assert rec.shown_paused is False and rec.end_at == r.end_at
        assert [x.sandbox_id for x in h.orch.table.list(states={"running"})] == [r.sandbox_id]
        assert h.orch.table.list(states={"paused"}) == []
        # Its metrics go on while it is on disk (idle).
        before = len(h.orch.metrics.series(r.sandbox_id))
        await idle_for(h, 10)
        series = h.orch.metrics.series(r.sandbox_id)
        assert len(series) == before + 2 and series[-1].cpu_used_pct == 0.0
        # Any request restores it: here the proxy's.
        up = await h.orch.pauser.resolve(r.sandbox_id, ENVD_PORT)
        rec = h.orch.table.get(r.sandbox_id)
        assert rec.state is SandboxState.RUNNING and rec.instance is not None
        assert up.host == rec.address and rec.end_at == r.end_at
        assert not frozen(h, r)


async def test_operations_restore_it_but_kill_and_pause_leave_it_on_disk(tmp_path: Path) -> None:
    async for h in started(tmp_path, nap_after=5.0, standby_after=5.0, standby_disk_after=5.0):
        a = await h.orch.sandboxes.create(CreateRequest())
        b = await h.orch.sandboxes.create(CreateRequest())
        await idle_for(h, 30)
        assert on_disk(h, a) and on_disk(h, b)
        await h.orch.snapshotter.snapshot(a.sandbox_id, "from-disk")
        assert h.orch.table.get(a.sandbox_id).state is SandboxState.RUNNING
        starts = h.runtime.ops().count("restore")
        await h.orch.pauser.pause(b.sandbox_id)  # now paused by its user, without a restore
        rec = h.orch.table.get(b.sandbox_id)
        assert rec.shown_paused and rec.tier is PauseTier.HIBERNATED
        assert h.runtime.ops().count("restore") == starts
        await h.orch.sandboxes.kill(b.sandbox_id)
        assert h.runtime.ops().count("restore") == starts
        assert [x.sandbox_id for x in h.orch.table.list()] == [a.sandbox_id]


async def test_its_timeout_still_ends_it(tmp_path: Path) -> None:
    async for h in started(tmp_path, nap_after=5.0, standby_after=5.0, standby_disk_after=5.0):
        r = await h.orch.sandboxes.create(CreateRequest(timeout=60))
        await idle_for(h, 30)
        assert on_disk(h, r)
        h.clock.advance(31)
        await h.orch.node.tick()
        assert h.orch.table.list() == []


async def test_a_create_the_budget_cannot_hold_sends_the_longest_idle_to_disk(
    tmp_path: Path,
) -> None:
    # Room for 3 of 512 MiB; no timer of its own would move them to disk (0: never).
    async for h in short_of_memory(tmp_path, 1536):
        first = await h.orch.sandboxes.create(CreateRequest(memory_mb=512))
        await idle_for(h, 5)
        second = await h.orch.sandboxes.create(CreateRequest(memory_mb=512))
        third = await h.orch.sandboxes.create(CreateRequest(memory_mb=512, standby_after=0))
        await idle_for(h, 30)
        assert frozen(h, first) and frozen(h, second) and not frozen(h, third)
        await h.orch.pauser.resolve(second.sandbox_id, ENVD_PORT)  # a request: idle shorter
        await idle_for(h, 15)
        fourth = await h.orch.sandboxes.create(CreateRequest(memory_mb=512))
        assert on_disk(h, first) and not on_disk(h, second)
        # Back on demand: the next longest idle in standby makes room for it.
        await h.orch.pauser.resolve(first.sandbox_id, ENVD_PORT)
        assert not on_disk(h, first) and on_disk(h, second)
        # None in standby now (third never goes, fourth and first had requests): full.
        with pytest.raises(Unavailable):
            await h.orch.sandboxes.create(CreateRequest(memory_mb=512))
        assert fourth.sandbox_id in {x.sandbox_id for x in h.orch.table.list()}


async def test_a_templates_standby_setting_applies_to_its_sandboxes(tmp_path: Path) -> None:
    async for h in started(tmp_path, nap_after=5.0):
        await h.orch.templates.set_standby("base", 10.0)
        opted = await h.orch.sandboxes.create(CreateRequest())
        own = await h.orch.sandboxes.create(CreateRequest(standby_after=0))
        await idle_for(h, 30)
        assert frozen(h, opted) and not frozen(h, own)
        await h.orch.templates.set_standby("base", None)
        assert (await h.orch.templates.get("base")).standby_after is None


async def test_creates_at_once_past_the_budget_each_get_room(tmp_path: Path) -> None:
    async for h in short_of_memory(tmp_path, 2048):
        idle = [await h.orch.sandboxes.create(CreateRequest(memory_mb=512)) for _ in range(4)]
        await idle_for(h, 20)
        assert all(frozen(h, r) for r in idle)
        made = await asyncio.gather(
            *(h.orch.sandboxes.create(CreateRequest(memory_mb=512)) for _ in range(4))
        )
        assert len(made) == 4 and all(on_disk(h, r) for r in idle)


async def test_a_request_to_one_on_disk_waits_for_room_rather_than_fail(tmp_path: Path) -> None:
    async for h in short_of_memory(tmp_path, 1024):
        sleeper = await h.orch.sandboxes.create(CreateRequest(memory_mb=512))
        await idle_for(h, 20)
        busy = [
            await h.orch.sandboxes.create(CreateRequest(memory_mb=512, standby_after=0))
            for _ in range(2)
        ]
        assert on_disk(h, sleeper)
        back = asyncio.create_task(h.orch.pauser.resolve(sleeper.sandbox_id, ENVD_PORT))
        await asyncio.sleep(0.5)
        assert not back.done()  # no room: nothing in standby to move
        await h.orch.sandboxes.kill(busy[0].sandbox_id)
        await asyncio.wait_for(back, 5)
        assert not on_disk(h, sleeper)
