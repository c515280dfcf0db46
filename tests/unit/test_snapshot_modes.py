"""Snapshots and fork beyond a running sandbox's memory, on the fake runtime: filesystem
snapshots (E2B `memory: false`), fork of a paused parent in each tier, `GET /snapshots/{id}`'s
lookup and the strict pause (`requireHealthyGuest`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.domain import CreateRequest, PauseTier, SandboxRecord, SandboxState, TemplateKind
from aenv.errors import NotFound, Unavailable
from aenv.runtime.fake import FakeState
from tests.node_harness import Harness, started

TIERS = [PauseTier.FROZEN, PauseTier.HIBERNATED, PauseTier.FILES]


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    async for h in started(tmp_path):
        yield h


def write_file(h: Harness, sandbox_id: str, name: str, text: str) -> None:
    """What a process in the sandbox writing a file leaves on the host: a file in its upper."""
    upper = h.orch.table.get(sandbox_id).upper
    assert upper is not None
    (Path(upper) / name).write_text(text)


def seen(h: Harness, r: SandboxRecord, name: str) -> str | None:
    """The file as the sandbox's overlay shows it: its upper first, then its layers."""
    dirs = [Path(r.upper)] if r.upper else []
    for d in [*dirs, *(h.orch.storage.layers.path(x) for x in r.layers)]:
        if (d / name).exists():
            return (d / name).read_text()
    return None


async def pause_in(h: Harness, sandbox_id: str, tier: PauseTier) -> None:
    await h.orch.pauser.pause(sandbox_id, memory=tier is not PauseTier.FILES)
    if tier is PauseTier.HIBERNATED:
        await h.orch.pauser.hibernate(sandbox_id)
    assert h.orch.table.get(sandbox_id).tier is tier


# ---------------------------------------------------------------------------- filesystem mode
async def test_filesystem_snapshot_copies_the_files_and_takes_no_checkpoint(
    node: Harness,
) -> None:
    r = await node.orch.sandboxes.create(CreateRequest(env_vars={"FROM_SOURCE": "1"}))
    inst, layers, upper = r.instance, list(r.layers), r.upper
    assert inst is not None
    write_file(node, r.sandbox_id, "a.txt", "before")
    node.runtime.calls.clear()

    snap = await node.orch.snapshotter.snapshot(r.sandbox_id, "fs-1", memory=False)

    # Frozen for the copy only: no checkpoint, no stop, no restore; same container.
    assert node.runtime.ops() == ["freeze", "thaw"]
    rec = node.orch.table.get(r.sandbox_id)
    assert rec.state is SandboxState.RUNNING and rec.instance == inst
    assert node.runtime.state(inst) is FakeState.RUNNING
    assert rec.layers == layers and rec.upper == upper  # it goes on in the same upper
    assert snap.kind is TemplateKind.SNAPSHOT and snap.checkpoint is None
    assert snap.layers[1:] == layers
    assert (node.orch.storage.layers.path(snap.layers[0]) / "a.txt").read_text() == "before"
    assert [s.template_id for s in await node.orch.templates.snapshots()] == [snap.template_id]

    # Later writes of the source are not in it; a sandbox made from it boots fresh on it.
    write_file(node, r.sandbox_id, "a.txt", "after")
    write_file(node, r.sandbox_id, "b.txt", "after")
    node.runtime.calls.clear()
    child = await node.orch.sandboxes.create(CreateRequest(template_id="fs-1"))
    assert "create" in node.runtime.ops() and "restore" not in node.runtime.ops()
    assert seen(node, child, "a.txt") == "before" and seen(node, child, "b.txt") is None
    assert node.envd.inits[-1][1]["env_vars"]["FROM_SOURCE"] == "1"


async def test_filesystem_snapshot_of_an_untouched_sandbox_adds_no_layer(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    snap = await node.orch.snapshotter.snapshot(r.sandbox_id, memory=False)
    assert snap.layers == r.layers and snap.checkpoint is None


@pytest.mark.parametrize("tier", TIERS)
async def test_filesystem_snapshot_leaves_a_paused_sandbox_as_it_is(
    node: Harness, tier: PauseTier
) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    write_file(node, r.sandbox_id, "p.txt", "paused")
    await pause_in(node, r.sandbox_id, tier)
    node.runtime.calls.clear()
    snap = await node.orch.snapshotter.snapshot(r.sandbox_id, memory=False)
    assert node.runtime.ops() == []  # nothing thawed, restored or booted
    assert node.orch.table.get(r.sandbox_id).tier is tier
    child = await node.orch.sandboxes.create(CreateRequest(template_id=snap.template_id))
    assert seen(node, child, "p.txt") == "paused"
    back, resumed = await node.orch.pauser.connect(r.sandbox_id, 60)
    assert resumed and seen(node, back, "p.txt") == "paused"


# ---------------------------------------------------------------------------- fork when paused
@pytest.mark.parametrize("tier", TIERS)
async def test_fork_of_a_paused_parent_leaves_it_paused(node: Harness, tier: PauseTier) -> None:
    parent = await node.orch.sandboxes.create(CreateRequest(metadata={"k": "v"}, timeout=30))
    write_file(node, parent.sandbox_id, "f.txt", "from the parent")
    await pause_in(node, parent.sandbox_id, tier)
    node.clock.advance(60)  # past the parent's deadline: the children get the default
    node.runtime.calls.clear()

    results = await node.orch.forker.fork(parent.sandbox_id, 2)

    kids = [res.sandbox for res in results if res.sandbox is not None]
    assert len(kids) == 2, [res.error for res in results]
    booted = "create" if tier is PauseTier.FILES else "restore"
    assert node.runtime.ops().count(booted) >= 2
    for k in kids:
        assert k.state is SandboxState.RUNNING and k.instance is not None
        assert node.runtime.state(k.instance) is FakeState.RUNNING
        assert k.lineage.parent_id == parent.sandbox_id and k.metadata == {"k": "v"}
        assert seen(node, k, "f.txt") == "from the parent"
        ttl = (k.end_at - node.clock.now).total_seconds()
        assert ttl == node.settings.default_timeout
    p = node.orch.table.get(parent.sandbox_id)
    assert p.state is SandboxState.PAUSED and p.tier is tier
    if tier is PauseTier.FROZEN:
        assert p.instance is not None and node.runtime.state(p.instance) is FakeState.FROZEN
    else:
        assert p.instance is None
    # The fork's own snapshot is gone.
    assert not [t for t in await node.orch.templates.all() if t.fork_of]
    back, resumed = await node.orch.pauser.connect(parent.sandbox_id, 60)
    assert resumed and seen(node, back, "f.txt") == "from the parent"


# ---------------------------------------------------------------------------- lookup
async def test_get_snapshot_finds_snapshots_only(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    full = await node.orch.snapshotter.snapshot(r.sandbox_id, "full-1")
    files = await node.orch.snapshotter.snapshot(r.sandbox_id, "files-1", memory=False)
    assert (await node.orch.templates.get_snapshot("full-1")).has_memory
    assert not (await node.orch.templates.get_snapshot(files.template_id)).has_memory
    assert (await node.orch.templates.get_snapshot(full.template_id)).names == ["full-1"]
    for other in ("base", "no-such-snapshot"):
        with pytest.raises(NotFound):
            await node.orch.templates.get_snapshot(other)


# ---------------------------------------------------------------------------- strict pause
async def test_strict_pause_is_refused_while_envd_does_not_answer(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    assert r.instance is not None and r.address is not None
    node.envd.unhealthy.add(r.address)
    for memory in (True, False):
        with pytest.raises(Unavailable, match="guest agent"):
            await node.orch.pauser.pause(r.sandbox_id, memory=memory, require_healthy_guest=True)
        rec = node.orch.table.get(r.sandbox_id)
        assert rec.state is SandboxState.RUNNING and rec.instance == r.instance
        assert node.runtime.state(r.instance) is FakeState.RUNNING
    # Without strict the pause goes ahead; with a healthy envd a strict one does too.
    await node.orch.pauser.pause(r.sandbox_id)
    assert node.orch.table.get(r.sandbox_id).tier is PauseTier.FROZEN
    other = await node.orch.sandboxes.create(CreateRequest())
    await node.orch.pauser.pause(other.sandbox_id, require_healthy_guest=True)
    assert node.orch.table.get(other.sandbox_id).tier is PauseTier.FROZEN
