"""Snapshots and fork in the node's lifecycle, on the fake runtime and a fake clock: a snapshot
keeps the sandbox running and copies only what changed, failing checkpoints and restores leave
it running, frozen or lost; fork's children, its failures and its memory budget.
"""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.domain import CreateRequest, PauseTier, SandboxState, TemplateKind
from aenv.errors import Conflict, NotFound, RuntimeFailure, Unavailable
from aenv.runtime.fake import FakeState
from tests.node_harness import Harness, started
from tests.unit.sandbox_files import entries, write_file


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    async for h in started(tmp_path):
        yield h


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
        assert k.lineage.parent_id == parent.sandbox_id and k.metadata == {"k": "v"}
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
