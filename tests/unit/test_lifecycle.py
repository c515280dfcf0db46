"""The node's lifecycle state machine, whole, on the fake runtime and a fake clock: timeouts,
pause tiers and the way back, restart recovery, concurrent operations on one sandbox, the warm
pool, and the stop listeners. Snapshots and fork are in test_lifecycle_snapshots.py, egress
rules and traffic tokens in test_lifecycle_network.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from aenv.domain import CreateRequest, PauseTier, SandboxState
from aenv.errors import Conflict, NotFound, RuntimeFailure, SandboxNotFound
from aenv.runtime.fake import FakeState
from tests.node_harness import Harness, build, started
from tests.unit.sandbox_files import write_file


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    async for h in started(tmp_path):
        yield h


# ---------------------------------------------------------------------------- timeouts
async def test_timeout_kills_a_sandbox(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest(timeout=30))
    inst = r.instance
    assert inst is not None
    node.clock.advance(29)
    await node.orch.node.tick()
    assert node.orch.table.get(r.sandbox_id).state is SandboxState.RUNNING
    node.clock.advance(2)
    await node.orch.node.tick()
    with pytest.raises(NotFound):
        node.orch.table.get(r.sandbox_id)
    assert node.runtime.state(inst) is FakeState.GONE
    assert node.catalog.sandboxes() == []


async def test_timeout_with_auto_pause_pauses(node: Harness) -> None:
    keep = await node.orch.sandboxes.create(CreateRequest(timeout=10, auto_pause=True))
    files = await node.orch.sandboxes.create(
        CreateRequest(timeout=10, auto_pause=True, auto_pause_memory=False)
    )
    node.clock.advance(11)
    await node.orch.node.tick()
    assert node.orch.table.get(keep.sandbox_id).tier is PauseTier.FROZEN
    assert node.orch.table.get(files.sandbox_id).tier is PauseTier.FILES
    assert node.orch.table.get(files.sandbox_id).instance is None


async def test_refresh_and_set_timeout_move_the_deadline(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest(timeout=10))
    node.clock.advance(8)
    await node.orch.sandboxes.set_timeout(r.sandbox_id, 60)
    node.clock.advance(30)
    await node.orch.node.tick()
    assert node.orch.table.get(r.sandbox_id).state is SandboxState.RUNNING


# ---------------------------------------------------------------------------- pause tiers
async def test_frozen_hibernates_after_idle(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    inst = r.instance
    assert inst is not None
    await node.orch.pauser.pause(r.sandbox_id)
    assert node.runtime.state(inst) is FakeState.FROZEN
    node.clock.advance(30)
    await node.orch.node.tick()
    assert node.orch.table.get(r.sandbox_id).tier is PauseTier.FROZEN
    node.clock.advance(31)
    await node.orch.node.tick()
    rec = node.orch.table.get(r.sandbox_id)
    assert rec.tier is PauseTier.HIBERNATED
    assert rec.instance is None
    assert node.runtime.state(inst) is FakeState.GONE
    assert rec.paused is not None and rec.paused.image is not None
    assert node.runtime.image_complete(node.settings.images_dir / rec.paused.image)


@pytest.mark.parametrize("tier", [PauseTier.FROZEN, PauseTier.HIBERNATED, PauseTier.FILES])
async def test_resume_from_each_tier(node: Harness, tier: PauseTier) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    write_file(node, r.sandbox_id, "note.txt", "kept")
    await node.orch.pauser.pause(r.sandbox_id, memory=tier is not PauseTier.FILES)
    if tier is PauseTier.HIBERNATED:
        await node.orch.pauser.hibernate(r.sandbox_id)
    assert node.orch.table.get(r.sandbox_id).tier is tier
    node.runtime.calls.clear()

    back, resumed = await node.orch.pauser.connect(r.sandbox_id, 120)
    assert resumed and back.state is SandboxState.RUNNING and back.paused is None
    assert back.instance is not None
    assert node.runtime.state(back.instance) is FakeState.RUNNING
    expected = {
        PauseTier.FROZEN: "thaw",
        PauseTier.HIBERNATED: "restore",
        PauseTier.FILES: "create",
    }
    assert expected[tier] in node.runtime.ops()
    # The files are there whichever way it came back (in a sealed layer or the kept upper).
    stack = [node.orch.storage.layers.path(d) for d in back.layers]
    assert back.upper is not None
    found = [p / "note.txt" for p in [Path(back.upper), *stack] if (p / "note.txt").exists()]
    assert [f.read_text() for f in found] == ["kept"]
    assert (back.end_at - node.clock.now).total_seconds() == 120


async def test_pause_twice_conflicts_and_resume_of_running_only_extends(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest(timeout=30))
    _, resumed = await node.orch.pauser.connect(r.sandbox_id, 100)
    assert not resumed
    assert (node.orch.table.get(r.sandbox_id).end_at - node.clock.now).total_seconds() == 100
    await node.orch.pauser.pause(r.sandbox_id)
    with pytest.raises(Conflict):
        await node.orch.pauser.pause(r.sandbox_id)


async def test_failed_resume_leaves_it_paused(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    await node.orch.pauser.pause(r.sandbox_id)
    await node.orch.pauser.hibernate(r.sandbox_id)
    node.runtime.fail_next("restore")
    with pytest.raises(RuntimeFailure):
        await node.orch.pauser.connect(r.sandbox_id, 60)
    assert node.orch.table.get(r.sandbox_id).tier is PauseTier.HIBERNATED
    back, resumed = await node.orch.pauser.connect(r.sandbox_id, 60)
    assert resumed and back.state is SandboxState.RUNNING


async def test_proxy_resolve_resumes_only_with_auto_resume(node: Harness) -> None:
    plain = await node.orch.sandboxes.create(CreateRequest())
    auto = await node.orch.sandboxes.create(CreateRequest(auto_resume=True))
    for r in (plain, auto):
        await node.orch.pauser.pause(r.sandbox_id)
    with pytest.raises(SandboxNotFound) as refused:
        await node.orch.pauser.resolve(plain.sandbox_id, 8080)
    assert refused.value.status == 502 and refused.value.state == "paused"
    up = await node.orch.pauser.resolve(auto.sandbox_id, 8080)
    assert up.port == 8080 and up.host == node.orch.table.get(auto.sandbox_id).address
    assert node.orch.table.get(auto.sandbox_id).state is SandboxState.RUNNING


async def test_an_auto_resume_gives_the_create_timeout_again(node: Harness) -> None:
    """As E2B documents: a sandbox woken by traffic runs for the timeout it was created with,
    from the resume, at least five minutes; a filesystem-only pause is never woken by
    traffic (its processes are gone: it is resumed only when asked)."""
    long = await node.orch.sandboxes.create(CreateRequest(auto_resume=True, timeout=900))
    short = await node.orch.sandboxes.create(CreateRequest(auto_resume=True, timeout=30))
    files = await node.orch.sandboxes.create(CreateRequest(auto_resume=True, timeout=900))
    for r in (long, short):
        await node.orch.pauser.pause(r.sandbox_id)
    await node.orch.pauser.pause(files.sandbox_id, memory=False)
    node.clock.advance(20)
    for r, ttl in ((long, 900), (short, 300)):
        await node.orch.pauser.resolve(r.sandbox_id, 8080)
        back = node.orch.table.get(r.sandbox_id)
        assert back.state is SandboxState.RUNNING
        assert back.end_at == node.clock.now + timedelta(seconds=ttl)
    with pytest.raises(SandboxNotFound) as refused:
        await node.orch.pauser.resolve(files.sandbox_id, 8080)
    assert refused.value.state == "paused"
    assert node.orch.table.get(files.sandbox_id).tier is PauseTier.FILES
    back, resumed = await node.orch.pauser.connect(files.sandbox_id, 60)
    assert resumed and back.state is SandboxState.RUNNING


# ---------------------------------------------------------------------------- restarts
async def test_restart_recovers_each_state(tmp_path: Path) -> None:
    h = build(tmp_path)
    await h.orch.start(timers=False)
    running = await h.orch.sandboxes.create(CreateRequest())
    frozen = await h.orch.sandboxes.create(CreateRequest())
    hibernated = await h.orch.sandboxes.create(CreateRequest())
    files = await h.orch.sandboxes.create(CreateRequest())
    died = await h.orch.sandboxes.create(CreateRequest())
    await h.orch.pauser.pause(frozen.sandbox_id)
    await h.orch.pauser.pause(hibernated.sandbox_id)
    await h.orch.pauser.hibernate(hibernated.sandbox_id)
    await h.orch.pauser.pause(files.sandbox_id, memory=False)
    assert died.instance is not None
    h.host.kill(died.instance.id)
    # kill -9 of the server: no close(); the containers stay on the host.
    h2 = await h.restart()
    await h2.orch.start(timers=False)
    try:
        assert h2.orch.table.get(running.sandbox_id).state is SandboxState.RUNNING
        assert h2.orch.table.get(running.sandbox_id).address == running.address
        assert h2.orch.table.get(frozen.sandbox_id).tier is PauseTier.FROZEN
        assert h2.orch.table.get(hibernated.sandbox_id).tier is PauseTier.HIBERNATED
        assert h2.orch.table.get(files.sandbox_id).tier is PauseTier.FILES
        with pytest.raises(NotFound, match="lost"):
            h2.orch.table.get(died.sandbox_id)
        assert {r.sandbox_id for r in h2.orch.table.list()} == {
            running.sandbox_id,
            frozen.sandbox_id,
            hibernated.sandbox_id,
            files.sandbox_id,
        }
        for r in (frozen, hibernated, files):
            back, resumed = await h2.orch.pauser.connect(r.sandbox_id, 60)
            assert resumed and back.state is SandboxState.RUNNING
    finally:
        await h2.orch.close()
        h2.catalog.close()


async def test_clean_shutdown_hibernates_frozen_sandboxes(tmp_path: Path) -> None:
    h = build(tmp_path)
    await h.orch.start(timers=False)
    r = await h.orch.sandboxes.create(CreateRequest())
    await h.orch.pauser.pause(r.sandbox_id)
    await h.orch.close()
    h2 = await h.restart()
    await h2.orch.start(timers=False)
    try:
        assert h2.orch.table.get(r.sandbox_id).tier is PauseTier.HIBERNATED
        assert h2.runtime.instances() == []
    finally:
        await h2.orch.close()
        h2.catalog.close()


# ---------------------------------------------------------------------------- concurrency
async def test_concurrent_pause_and_kill(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    results = await asyncio.gather(
        node.orch.pauser.pause(r.sandbox_id),
        node.orch.sandboxes.kill(r.sandbox_id),
        return_exceptions=True,
    )
    assert not any(isinstance(x, Exception) and not isinstance(x, NotFound) for x in results)
    with pytest.raises(NotFound):
        node.orch.table.get(r.sandbox_id)
    assert node.runtime.instances() == []


async def test_concurrent_pauses_one_wins(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    results = await asyncio.gather(
        *(node.orch.pauser.pause(r.sandbox_id) for _ in range(3)), return_exceptions=True
    )
    assert sum(x is None for x in results) == 1
    assert all(isinstance(x, Conflict) for x in results if x is not None)


async def test_snapshot_and_kill_do_not_interleave(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    other = await node.orch.sandboxes.create(CreateRequest())
    held, release = asyncio.Event(), asyncio.Event()

    async def hold(_call: object) -> None:
        held.set()
        await release.wait()

    node.runtime.before("checkpoint", hold)
    snap = asyncio.create_task(node.orch.snapshotter.snapshot(r.sandbox_id))
    await asyncio.wait_for(held.wait(), 10)  # the snapshot is inside, holding the lock
    kill = asyncio.create_task(node.orch.sandboxes.kill(r.sandbox_id))
    # A whole kill of another sandbox, started after it: time enough for this one too, had
    # it not been waiting.
    await node.orch.sandboxes.kill(other.sandbox_id)
    assert not kill.done()  # waits for the snapshot's lock
    release.set()
    made = await snap
    await kill
    assert made.checkpoint is not None
    assert node.runtime.instances() == []


# ---------------------------------------------------------------------------- warm pool
async def test_warm_pool_hands_out_a_preboted_sandbox(tmp_path: Path) -> None:
    async for h in started(tmp_path, sandbox_pool_size=1):
        for _ in range(100):
            if any(op == "create" for op in h.runtime.ops()):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        booted = len(h.runtime.instances())
        assert booted == 1
        r = await h.orch.sandboxes.create(CreateRequest(metadata={"a": "b"}, env_vars={"X": "1"}))
        assert r.metadata == {"a": "b"}
        assert h.envd.inits[-1][1]["env_vars"] == {"LANG": "C.UTF-8", "X": "1"}
        assert h.runtime.ops().count("create") == 1  # no boot for the create itself


async def test_snapshot_of_a_hibernated_sandbox_shares_its_image(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    write_file(node, r.sandbox_id, "h.txt", "on disk")
    await node.orch.pauser.pause(r.sandbox_id)
    await node.orch.pauser.hibernate(r.sandbox_id)
    ops = len(node.runtime.calls)
    snap = await node.orch.snapshotter.snapshot(r.sandbox_id, "from-disk")
    assert node.runtime.ops()[ops:] == []  # nothing was started for it
    assert node.orch.table.get(r.sandbox_id).tier is PauseTier.HIBERNATED
    child = await node.orch.sandboxes.create(CreateRequest(template_id="from-disk"))
    assert child.layers == snap.layers
    assert (node.orch.storage.layers.path(snap.layers[0]) / "h.txt").read_text() == "on disk"


async def test_killing_a_hibernated_sandbox_drops_its_image(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    await node.orch.pauser.pause(r.sandbox_id)
    await node.orch.pauser.hibernate(r.sandbox_id)
    paused = node.orch.table.get(r.sandbox_id).paused
    assert paused is not None and paused.image is not None
    image = node.settings.images_dir / paused.image
    assert node.runtime.image_complete(image)
    await node.orch.sandboxes.kill(r.sandbox_id)
    assert not image.exists()
    assert not (node.settings.rw_dir / r.sandbox_id).exists()


async def test_stop_listeners_hear_of_every_end_of_a_sandboxes_processes(node: Harness) -> None:
    """The data plane breaks off streams on this: a kill, a hibernation and a files-only pause
    end the processes; a freeze keeps them (they go on after the thaw)."""
    heard: list[str] = []
    node.orch.context.on_stopped(heard.append)
    frozen = await node.orch.sandboxes.create(CreateRequest())
    files = await node.orch.sandboxes.create(CreateRequest())
    killed = await node.orch.sandboxes.create(CreateRequest())
    await node.orch.pauser.pause(frozen.sandbox_id)
    assert heard == []
    await node.orch.pauser.hibernate(frozen.sandbox_id)
    await node.orch.pauser.pause(files.sandbox_id, memory=False)
    await node.orch.sandboxes.kill(killed.sandbox_id)
    assert heard == [frozen.sandbox_id, files.sandbox_id, killed.sandbox_id]
