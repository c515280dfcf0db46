"""The node's lifecycle state machine, whole, on the fake runtime and a fake clock: timeouts,
pause tiers and the way back, snapshots and fork with failures, restart recovery, and
concurrent operations on one sandbox."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.domain import (
    ENVD_PORT,
    CreateRequest,
    EgressPolicy,
    PauseTier,
    SandboxState,
    TemplateKind,
)
from aenv.errors import (
    Conflict,
    Forbidden,
    NotFound,
    RuntimeFailure,
    SandboxNotFound,
    Unavailable,
)
from aenv.runtime.fake import FakeState
from tests.node_harness import Harness, build, started


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    async for h in started(tmp_path):
        yield h


def write_file(h: Harness, sandbox_id: str, name: str, text: str) -> None:
    """What a process in the sandbox writing a file leaves on the host: a file in its upper."""
    upper = h.orch.table.get(sandbox_id).upper
    assert upper is not None
    (Path(upper) / name).write_text(text)


def entries(path: str) -> list[str]:
    return [p.name for p in Path(path).iterdir()]


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


# ---------------------------------------------------------------------------- snapshots
async def test_snapshot_keeps_the_sandbox_running_and_copies_its_files(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    assert r.instance is not None
    address, upper, before = r.address, r.upper, len(node.runtime.ops())
    write_file(node, r.sandbox_id, "a.txt", "1")
    snap = await node.orch.snapshotter.snapshot(r.sandbox_id, "snap-1")
    rec = node.orch.table.get(r.sandbox_id)
    # Not stopped nor restored: the same container goes on in the same upper.
    assert rec.state is SandboxState.RUNNING and rec.address == address
    assert rec.instance is not None and rec.instance.id == r.instance.id
    assert node.runtime.state(rec.instance) is FakeState.RUNNING
    assert node.runtime.ops()[before:] == ["checkpoint", "thaw"]
    assert rec.upper is not None and rec.upper == upper and entries(rec.upper) == ["a.txt"]
    assert snap.kind is TemplateKind.SNAPSHOT and snap.checkpoint is not None
    assert snap.layers == [*rec.copied_as, *rec.layers] and len(snap.layers) == 2
    assert (node.orch.storage.layers.path(snap.layers[0]) / "a.txt").read_text() == "1"
    assert [s.template_id for s in await node.orch.templates.snapshots()] == [snap.template_id]

    child = await node.orch.sandboxes.create(CreateRequest(template_id="snap-1"))
    assert child.layers == snap.layers and child.instance is not None
    assert node.runtime.ops().count("restore") == 1  # the child only
    with pytest.raises(Conflict):
        await node.orch.snapshotter.snapshot(r.sandbox_id, "snap-1")


async def test_later_snapshots_take_only_what_changed(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    write_file(node, r.sandbox_id, "a.txt", "1")
    first = await node.orch.snapshotter.snapshot(r.sandbox_id)
    write_file(node, r.sandbox_id, "b.txt", "2")
    second = await node.orch.snapshotter.snapshot(r.sandbox_id)
    assert second.layers[1:] == first.layers
    assert entries(str(node.orch.storage.layers.path(second.layers[0]))) == ["b.txt"]
    same = await node.orch.snapshotter.snapshot(r.sandbox_id)  # nothing changed: no new layer
    assert same.layers == second.layers
    upper = node.orch.table.get(r.sandbox_id).upper
    assert upper is not None
    (Path(upper) / "a.txt").unlink()
    third = await node.orch.snapshotter.snapshot(r.sandbox_id)
    gone = node.orch.storage.layers.path(third.layers[0]) / "a.txt"
    if os.geteuid() == 0:  # a whiteout (a device node) hides the first copy's a.txt
        assert stat.S_ISCHR(os.lstat(gone).st_mode)
    assert third.layers[1:] == second.layers


async def test_snapshot_whose_checkpoint_fails_leaves_the_sandbox_running(
    node: Harness,
) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    node.runtime.fail_next("checkpoint")
    with pytest.raises(RuntimeFailure):
        await node.orch.snapshotter.snapshot(r.sandbox_id)
    rec = node.orch.table.get(r.sandbox_id)
    assert rec.state is SandboxState.RUNNING and rec.pending is None
    assert rec.instance is not None
    assert node.runtime.state(rec.instance) is FakeState.RUNNING
    assert await node.orch.templates.snapshots() == []


async def test_snapshot_of_a_frozen_sandbox_whose_restore_fails_marks_it_lost(
    node: Harness,
) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    await node.orch.pauser.pause(r.sandbox_id)
    node.runtime.fail_next("restore")
    with pytest.raises(RuntimeFailure):
        await node.orch.snapshotter.snapshot(r.sandbox_id)
    with pytest.raises(NotFound, match="lost"):
        node.orch.table.get(r.sandbox_id)
    assert node.runtime.instances() == []


async def test_snapshot_of_a_frozen_sandbox_leaves_it_frozen(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    await node.orch.pauser.pause(r.sandbox_id)
    await node.orch.snapshotter.snapshot(r.sandbox_id)
    rec = node.orch.table.get(r.sandbox_id)
    assert rec.tier is PauseTier.FROZEN and rec.instance is not None
    assert node.runtime.state(rec.instance) is FakeState.FROZEN


# ---------------------------------------------------------------------------- fork
async def test_fork_children_and_parent(node: Harness) -> None:
    parent = await node.orch.sandboxes.create(CreateRequest(metadata={"k": "v"}))
    write_file(node, parent.sandbox_id, "f", "x")
    results = await node.orch.forker.fork(parent.sandbox_id, 3)
    kids = [res.sandbox for res in results if res.sandbox is not None]
    assert len(kids) == 3 and all(res.error is None for res in results)
    addresses = {k.address for k in kids} | {node.orch.table.get(parent.sandbox_id).address}
    assert len(addresses) == 4
    for k in kids:
        assert k.parent_id == parent.sandbox_id and k.metadata == {"k": "v"}
        p = node.orch.table.get(parent.sandbox_id)  # children run on a copy of its upper
        assert k.layers == [*p.copied_as, *p.layers] and len(p.copied_as) == 1
        assert k.envd_access_token != parent.envd_access_token or not k.envd_access_token
    # The fork's snapshot is gone; the children's layers stay.
    assert await node.orch.templates.snapshots() == []
    assert all(node.orch.storage.layers.has(d) for d in kids[0].layers)


async def test_fork_with_a_failing_child_reports_it(node: Harness) -> None:
    parent = await node.orch.sandboxes.create(CreateRequest())
    # The parent goes on without a restore; the second child's fails.
    node.runtime.fail_next("restore", after=1)
    results = await node.orch.forker.fork(parent.sandbox_id, 3)
    assert sum(res.sandbox is not None for res in results) == 2
    errors = [res.error for res in results if res.error is not None]
    assert len(errors) == 1 and "injected" in errors[0].message
    assert node.orch.table.get(parent.sandbox_id).state is SandboxState.RUNNING
    assert len(node.orch.table.list()) == 3


async def test_fork_past_the_memory_budget(tmp_path: Path) -> None:
    async for h in started(tmp_path, max_memory_mb=1536):
        parent = await h.orch.sandboxes.create(CreateRequest())
        results = await h.orch.forker.fork(parent.sandbox_id, 3)
        assert sum(res.sandbox is not None for res in results) == 2
        assert any(isinstance(res.error, Unavailable) for res in results)
        with pytest.raises(Unavailable):
            await h.orch.sandboxes.create(CreateRequest())


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
