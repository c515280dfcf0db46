"""Volume mounts through the lifecycle, on the fake runtime (which, like runsc, restores a
checkpoint only with the mounts it was taken with): every boot, restore, pause tier, snapshot
and fork child gets the sandbox's volumes; deletes and bad mounts are refused."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aenv.domain import CreateRequest, MountRequest, SandboxRecord
from aenv.errors import BadRequest, Conflict
from aenv.runtime.bundle import MOUNT
from tests.node_harness import Harness, started


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    async for h in started(tmp_path):
        yield h


def mounts(h: Harness, r: SandboxRecord) -> list[list[Any]]:
    """The volume bind mounts of the sandbox's current container."""
    rec = h.orch.table.get(r.sandbox_id)
    assert rec.instance is not None
    return [m for m in h.host.containers[rec.instance.id].mounts if m[1] != MOUNT]


async def test_mounts_follow_every_boot(node: Harness) -> None:
    vol = await node.orch.volumes.create("data")
    data = str(node.settings.volumes_dir / vol.volume_id / "data")
    want = [[data, "/mnt/data", True]]
    r = await node.orch.sandboxes.create(
        CreateRequest(volume_mounts=[MountRequest("data", "/mnt/data/", read_only=True)])
    )
    assert mounts(node, r) == want
    for memory, hibernate in ((True, False), (True, True), (False, False)):
        await node.orch.pauser.pause(r.sandbox_id, memory=memory)
        if hibernate:
            await node.orch.pauser.hibernate(r.sandbox_id)
        await node.orch.pauser.connect(r.sandbox_id, 60)
        assert mounts(node, r) == want
    snap = await node.orch.snapshotter.snapshot(r.sandbox_id)
    assert mounts(node, r) == want  # restored in place with them
    child = await node.orch.sandboxes.create(CreateRequest(template_id=snap.template_id))
    assert mounts(node, child) == want
    kids = await node.orch.forker.fork(r.sandbox_id, 2)
    assert all(k.sandbox is not None and mounts(node, k.sandbox) == want for k in kids)

    # A snapshot's sandboxes mount its volumes; asking for others there is refused.
    await node.orch.volumes.create("other")
    with pytest.raises(BadRequest, match="snapshot"):
        await node.orch.sandboxes.create(
            CreateRequest(template_id=snap.template_id, volume_mounts=[MountRequest("other", "/o")])
        )

    # The volume cannot go while sandboxes (paused ones too) mount it.
    await node.orch.pauser.pause(r.sandbox_id)
    with pytest.raises(Conflict, match=r.sandbox_id):
        await node.orch.volumes.delete(vol.volume_id)
    for s in node.orch.table.list():
        await node.orch.sandboxes.kill(s.sandbox_id)
    await node.orch.volumes.delete(vol.volume_id)
    with pytest.raises(BadRequest, match="was deleted"):
        await node.orch.sandboxes.create(CreateRequest(template_id=snap.template_id))


async def test_bad_mounts_are_refused_before_booting(node: Harness) -> None:
    await node.orch.volumes.create("v")
    for wanted in (
        [MountRequest("nope", "/mnt")],
        [MountRequest("v", "/opt")],
        [MountRequest("v", "/proc/x")],
        [MountRequest("v", "/a"), MountRequest("v", "/a/b")],
    ):
        node.runtime.calls.clear()
        with pytest.raises(BadRequest):
            await node.orch.sandboxes.create(CreateRequest(volume_mounts=wanted))
        assert "create" not in node.runtime.ops()
    assert node.orch.table.list() == []
