"""Sandboxes whose runtime dies under them (the host's OOM killer, a crashed sentry) are
noticed by the node's timers: reported lost with the cause, and what they held released."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.domain import CreateRequest, PauseTier, SandboxState
from aenv.errors import NotFound
from aenv.orchestrator.node import LIVENESS_EVERY_TICKS
from aenv.runtime.fake import FakeState
from tests.node_harness import Harness, started


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    async for h in started(tmp_path):
        yield h


async def tick_until_swept(h: Harness) -> None:
    for _ in range(LIVENESS_EVERY_TICKS):
        await h.orch.node.tick()


async def test_a_sandbox_killed_at_its_memory_limit_is_reported_and_released(
    node: Harness,
) -> None:
    dying = await node.orch.sandboxes.create(CreateRequest())
    other = await node.orch.sandboxes.create(CreateRequest())
    inst, upper = dying.instance, dying.upper  # the record changes as the sandbox dies
    assert inst is not None and upper is not None
    used = node.orch.table.memory_in_use()
    node.host.kill(inst.id, cause="the host killed it at its memory limit (512 MiB)")

    await tick_until_swept(node)

    with pytest.raises(NotFound, match="died while running: the host killed it at its memory"):
        node.orch.table.get(dying.sandbox_id)
    assert [r.sandbox_id for r in node.orch.table.list()] == [other.sandbox_id]
    assert node.runtime.state(inst) is FakeState.GONE  # slot given back
    assert not await asyncio.to_thread(os.path.exists, upper)
    assert node.orch.table.memory_in_use() == used - dying.memory_mb
    stored = {r.sandbox_id: r for r in node.catalog.sandboxes()}
    assert stored[dying.sandbox_id].state is SandboxState.LOST  # survives a restart as lost
    assert node.orch.table.get(other.sandbox_id).state is SandboxState.RUNNING


async def test_a_frozen_sandbox_that_died_is_lost_and_a_hibernated_one_is_not_touched(
    node: Harness,
) -> None:
    frozen = await node.orch.sandboxes.create(CreateRequest())
    hibernated = await node.orch.sandboxes.create(CreateRequest())
    await node.orch.pauser.pause(frozen.sandbox_id)
    await node.orch.pauser.pause(hibernated.sandbox_id)
    await node.orch.pauser.hibernate(hibernated.sandbox_id)
    assert frozen.instance is not None
    node.host.kill(frozen.instance.id)

    assert await node.orch.liveness.sweep() == [frozen.sandbox_id]

    with pytest.raises(NotFound, match="died while paused: its processes exited"):
        node.orch.table.get(frozen.sandbox_id)
    assert node.orch.table.get(hibernated.sandbox_id).tier is PauseTier.HIBERNATED
    back, resumed = await node.orch.pauser.connect(hibernated.sandbox_id, 60)
    assert resumed and back.state is SandboxState.RUNNING


async def test_a_sandbox_mid_operation_is_left_for_a_later_sweep(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    assert r.instance is not None
    node.host.kill(r.instance.id)
    async with node.orch.table.lock(r.sandbox_id):
        assert await node.orch.liveness.sweep() == []
    assert await node.orch.liveness.sweep() == [r.sandbox_id]
