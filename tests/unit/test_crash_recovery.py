"""kill -9 of the server in the middle of an operation, on the fake runtime: the operation
hangs at one of its runtime calls (the node "dies" there: nothing after it runs, no cleanup),
a new node starts over the same home and host, and what it lists must be usable."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from aenv.domain import CreateRequest, PauseTier, SandboxState
from aenv.images.cache import holder
from aenv.runtime.fake import Call, FakeState
from tests.node_harness import Harness, build


class Crash:
    """An operation of the first node, stopped for good at a runtime call."""

    def __init__(self, h: Harness, op: str, *, after: int = 0, hung: int = 1) -> None:
        # `hung`: how many calls must be stuck before the node "dies" — an operation with
        # concurrent branches (fork's parent and children) is cut only once every branch is,
        # else a branch still running would write under the second node's feet.
        self.h, self.op, self.left, self.hung = h, op, after, hung
        self.reached = asyncio.Event()
        self._never = asyncio.Event()
        self.task: asyncio.Task[Any] | None = None
        h.runtime.before(op, self._hang)

    async def _hang(self, _call: Call) -> None:
        if self.left > 0:
            self.left -= 1
            return
        self.hung -= 1
        if self.hung <= 0:
            self.reached.set()
        await self._never.wait()

    async def during(self, coro: Coroutine[Any, Any, Any]) -> Harness:
        """Runs `coro` until it reaches the call, then starts the second node."""
        self.task = asyncio.ensure_future(coro)
        await asyncio.wait_for(self.reached.wait(), 5)
        h2 = await self.h.restart()
        await h2.orch.start(timers=False)
        return h2

    def forget(self) -> None:
        # The first node's task never goes on; dropped without running its cleanup.
        if self.task is not None:
            self.task.cancel()


async def _both(crash: Crash, h2: Harness, check: Callable[[], Awaitable[None]]) -> None:
    try:
        await check()
    finally:
        await h2.orch.close()
        h2.catalog.close()
        crash.forget()
        with contextlib.suppress(BaseException):
            await asyncio.sleep(0)


def write_file(h: Harness, sandbox_id: str, name: str, text: str) -> None:
    upper = h.orch.table.get(sandbox_id).upper
    assert upper is not None
    (Path(upper) / name).write_text(text)


def read_file(h: Harness, sandbox_id: str, name: str) -> str:
    r = h.orch.table.get(sandbox_id)
    dirs = [Path(r.upper)] if r.upper else []
    dirs += [h.orch.storage.layers.path(d) for d in r.layers]
    for d in dirs:
        if (d / name).exists():
            return (d / name).read_text()
    raise FileNotFoundError(name)


def live_containers(h: Harness) -> dict[str, FakeState]:
    return {c.id: c.state for c in h.host.containers.values() if c.state is not FakeState.GONE}


def agrees(h: Harness) -> None:
    """The catalog and the runtime agree: every container on the host is a listed sandbox's
    (running or frozen as listed), every listed sandbox's upper dir and nothing else is under
    rw/, and every memory image belongs to a template or a hibernated sandbox."""
    listed = {r.sandbox_id: r for r in h.orch.table.list()}
    want: dict[str, FakeState] = {}
    for r in listed.values():
        if r.instance is not None:
            want[r.instance.id] = (
                FakeState.FROZEN if r.tier is PauseTier.FROZEN else FakeState.RUNNING
            )
        else:
            assert r.state is SandboxState.PAUSED and r.tier in (
                PauseTier.HIBERNATED,
                PauseTier.FILES,
            )
    assert live_containers(h) == want
    assert {p.name for p in h.settings.rw_dir.iterdir()} == set(listed)
    for r in listed.values():
        assert r.upper is not None and Path(r.upper).is_dir()
        gens = list((h.settings.rw_dir / r.sandbox_id).iterdir())
        assert gens == [Path(r.upper).parent]
    images = {p.name for p in h.settings.images_dir.iterdir()}
    used = {r.paused.image for r in listed.values() if r.paused and r.paused.image}
    assert images <= used | {t.checkpoint for t in h.catalog.templates() if t.checkpoint}


async def back_in_use(h: Harness, sandbox_id: str) -> None:
    """The sandbox resumes (if paused), and can be paused and snapshotted again."""
    r, _ = await h.orch.pauser.connect(sandbox_id, 60)
    assert r.state is SandboxState.RUNNING and r.instance is not None
    assert h.runtime.state(r.instance) is FakeState.RUNNING
    await h.orch.pauser.pause(sandbox_id)
    await h.orch.pauser.connect(sandbox_id, 60)
    await h.orch.snapshotter.snapshot(sandbox_id)


async def node(tmp_path: Path, **overrides: Any) -> Harness:
    h = build(tmp_path, **overrides)
    await h.orch.start(timers=False)
    return h


# ---------------------------------------------------------------------------- snapshot
async def test_snapshot_cut_while_held_goes_on_running(tmp_path: Path) -> None:
    """A live snapshot cut after its checkpoint, while the sandbox is held for the copy of
    its upper: the sandbox goes on running (let go, same container, same files), and the
    unregistered snapshot is neither listed nor left on disk."""
    h = await node(tmp_path)
    r = await h.orch.sandboxes.create(CreateRequest())
    assert r.instance is not None
    write_file(h, r.sandbox_id, "a.txt", "before")
    crash = Crash(h, "thaw")
    h2 = await crash.during(h.orch.snapshotter.snapshot(r.sandbox_id, "cut"))

    async def check() -> None:
        back = h2.orch.table.get(r.sandbox_id)
        assert back.state is SandboxState.RUNNING and back.instance is not None
        assert back.instance.id == r.instance.id  # type: ignore[union-attr]
        assert h2.runtime.state(back.instance) is FakeState.RUNNING
        assert back.pending is None
        assert await h2.orch.templates.snapshots() == []
        assert h2.catalog.template("cut") is None
        agrees(h2)
        assert read_file(h2, r.sandbox_id, "a.txt") == "before"
        await back_in_use(h2, r.sandbox_id)

    await _both(crash, h2, check)


async def test_snapshot_cut_in_its_checkpoint_goes_on_running(tmp_path: Path) -> None:
    h = await node(tmp_path)
    r = await h.orch.sandboxes.create(CreateRequest())
    assert r.instance is not None
    crash = Crash(h, "checkpoint")
    h2 = await crash.during(h.orch.snapshotter.snapshot(r.sandbox_id))

    async def check() -> None:
        back = h2.orch.table.get(r.sandbox_id)
        assert back.state is SandboxState.RUNNING and back.instance is not None
        assert back.instance.id == r.instance.id  # type: ignore[union-attr]
        assert back.pending is None
        agrees(h2)
        assert list(h2.settings.images_dir.iterdir()) == []  # the partial image went
        await back_in_use(h2, r.sandbox_id)

    await _both(crash, h2, check)


async def test_snapshot_of_a_frozen_sandbox_cut_stays_paused(tmp_path: Path) -> None:
    h = await node(tmp_path)
    r = await h.orch.sandboxes.create(CreateRequest())
    await h.orch.pauser.pause(r.sandbox_id)
    crash = Crash(h, "checkpoint")  # after its thaw: the container runs again
    h2 = await crash.during(h.orch.snapshotter.snapshot(r.sandbox_id))

    async def check() -> None:
        back = h2.orch.table.get(r.sandbox_id)
        assert back.tier is PauseTier.FROZEN
        agrees(h2)  # frozen again, as listed
        await back_in_use(h2, r.sandbox_id)

    await _both(crash, h2, check)


# ---------------------------------------------------------------------------- fork
async def test_fork_cut_while_parent_and_children_restore(tmp_path: Path) -> None:
    """The other reported hole (fork at 400 ms): the parent usable, no child listed, the
    fork's own snapshot gone, no child's upper left under rw/."""
    h = await node(tmp_path, boot_concurrency=4)
    r = await h.orch.sandboxes.create(CreateRequest())
    write_file(h, r.sandbox_id, "p.txt", "parent")
    crash = Crash(h, "restore", hung=3)  # the 3 children's (the parent is not restored)
    h2 = await crash.during(h.orch.forker.fork(r.sandbox_id, 3))

    async def check() -> None:
        assert [x.sandbox_id for x in h2.orch.table.list()] == [r.sandbox_id]
        assert h2.orch.table.get(r.sandbox_id).state is SandboxState.RUNNING
        assert [t for t in h2.catalog.templates() if t.internal] == []
        agrees(h2)
        assert read_file(h2, r.sandbox_id, "p.txt") == "parent"
        await back_in_use(h2, r.sandbox_id)
        kids = await h2.orch.forker.fork(r.sandbox_id, 2)
        assert all(k.sandbox is not None for k in kids)

    await _both(crash, h2, check)


# ---------------------------------------------------------------------------- hibernate
async def test_hibernation_cut_after_its_checkpoint_keeps_memory_and_files(
    tmp_path: Path,
) -> None:
    """The reported hole (hibernation at 80 ms): the sandbox was called lost although its
    files were on disk."""
    h = await node(tmp_path)
    r = await h.orch.sandboxes.create(CreateRequest())
    write_file(h, r.sandbox_id, "h.txt", "hib")
    await h.orch.pauser.pause(r.sandbox_id)
    crash = Crash(h, "destroy")
    h2 = await crash.during(h.orch.pauser.hibernate(r.sandbox_id))

    async def check() -> None:
        back = h2.orch.table.get(r.sandbox_id)
        assert back.tier is PauseTier.HIBERNATED and back.paused is not None
        assert back.paused.image is not None and back.paused.image.startswith("hib-")
        agrees(h2)
        assert read_file(h2, r.sandbox_id, "h.txt") == "hib"
        await back_in_use(h2, r.sandbox_id)

    await _both(crash, h2, check)


async def test_hibernation_cut_in_its_checkpoint_stays_frozen(tmp_path: Path) -> None:
    h = await node(tmp_path)
    r = await h.orch.sandboxes.create(CreateRequest())
    await h.orch.pauser.pause(r.sandbox_id)
    crash = Crash(h, "checkpoint")
    h2 = await crash.during(h.orch.pauser.hibernate(r.sandbox_id))

    async def check() -> None:
        assert h2.orch.table.get(r.sandbox_id).tier is PauseTier.FROZEN
        agrees(h2)
        assert list(h2.settings.images_dir.iterdir()) == []
        await back_in_use(h2, r.sandbox_id)

    await _both(crash, h2, check)


async def test_seal_cut_before_its_record_was_saved_loses_no_file(tmp_path: Path) -> None:
    """A crash between moving the upper into the layer store and saving the record: the
    layer is found by the digest the operation chose up front."""
    h = await node(tmp_path)
    r = await h.orch.sandboxes.create(CreateRequest())
    write_file(h, r.sandbox_id, "s.txt", "sealed")
    await h.orch.pauser.pause(r.sandbox_id)
    stored: list[Any] = []

    def keep_saved(call: Call) -> None:
        # What the catalog holds at the hibernation's checkpoint (pending, old upper).
        stored.extend(h.catalog.sandboxes())

    h.runtime.before("checkpoint", keep_saved)
    await h.orch.pauser.hibernate(r.sandbox_id)
    (before,) = stored
    assert before.pending is not None and before.pending.layer is not None
    # The catalog as the crash would have left it: the seal done, its record not saved.
    h.catalog.put_sandbox(before)
    h2 = await h.restart()
    await h2.orch.start(timers=False)
    try:
        back = h2.orch.table.get(r.sandbox_id)
        assert back.tier is PauseTier.HIBERNATED
        assert back.layers[0] == before.pending.layer
        assert read_file(h2, r.sandbox_id, "s.txt") == "sealed"
        agrees(h2)
        await back_in_use(h2, r.sandbox_id)
    finally:
        await h2.orch.close()
        h2.catalog.close()


# ---------------------------------------------------------------------------- pause, create
async def test_pause_to_files_cut_comes_back_paused(tmp_path: Path) -> None:
    h = await node(tmp_path)
    r = await h.orch.sandboxes.create(CreateRequest())
    write_file(h, r.sandbox_id, "f.txt", "files")
    crash = Crash(h, "destroy")
    # Its container dies as the crash takes the node (destroy's first act is a SIGKILL).
    assert r.instance is not None
    h.host.kill(r.instance.id)
    h2 = await crash.during(h.orch.pauser.pause(r.sandbox_id, memory=False))

    async def check() -> None:
        assert h2.orch.table.get(r.sandbox_id).tier is PauseTier.FILES
        agrees(h2)
        assert read_file(h2, r.sandbox_id, "f.txt") == "files"
        await back_in_use(h2, r.sandbox_id)

    await _both(crash, h2, check)


async def test_container_frozen_before_its_record_said_so_is_thawed(tmp_path: Path) -> None:
    """A crash between a pause's freeze and its save: listed running, so running it is."""
    h = await node(tmp_path)
    r = await h.orch.sandboxes.create(CreateRequest())
    assert r.instance is not None
    await h.runtime.freeze(r.instance)
    h2 = await h.restart()
    await h2.orch.start(timers=False)
    try:
        assert h2.orch.table.get(r.sandbox_id).state is SandboxState.RUNNING
        agrees(h2)
        await back_in_use(h2, r.sandbox_id)
    finally:
        await h2.orch.close()
        h2.catalog.close()


async def test_frozen_sandbox_whose_container_is_gone_keeps_its_files(tmp_path: Path) -> None:
    h = await node(tmp_path)
    r = await h.orch.sandboxes.create(CreateRequest())
    write_file(h, r.sandbox_id, "k.txt", "kept")
    await h.orch.pauser.pause(r.sandbox_id)
    assert r.instance is not None
    h.host.kill(r.instance.id)  # e.g. the host rebooted
    h2 = await h.restart()
    await h2.orch.start(timers=False)
    try:
        assert h2.orch.table.get(r.sandbox_id).tier is PauseTier.FILES
        agrees(h2)
        assert read_file(h2, r.sandbox_id, "k.txt") == "kept"
        await back_in_use(h2, r.sandbox_id)
    finally:
        await h2.orch.close()
        h2.catalog.close()


async def test_create_cut_leaves_nothing_listed_nor_on_disk(tmp_path: Path) -> None:
    h = await node(tmp_path)
    kept = await h.orch.sandboxes.create(CreateRequest())
    crash = Crash(h, "create")
    h2 = await crash.during(h.orch.sandboxes.create(CreateRequest()))

    async def check() -> None:
        assert [x.sandbox_id for x in h2.orch.table.list()] == [kept.sandbox_id]
        agrees(h2)
        holders = h2.orch.storage.refs.all_holders()  # noqa: SLF001
        assert {x for x in holders if x.startswith("sandbox:")} == {
            holder("sandbox", kept.sandbox_id)
        }

    await _both(crash, h2, check)


async def test_every_snapshot_reported_created_survives_a_cut_snapshot(tmp_path: Path) -> None:
    h = await node(tmp_path)
    r = await h.orch.sandboxes.create(CreateRequest())
    write_file(h, r.sandbox_id, "one.txt", "1")
    first = await h.orch.snapshotter.snapshot(r.sandbox_id, "first")
    crash = Crash(h, "thaw")
    h2 = await crash.during(h.orch.snapshotter.snapshot(r.sandbox_id, "second"))

    async def check() -> None:
        assert [s.template_id for s in await h2.orch.templates.snapshots()] == [first.template_id]
        agrees(h2)
        child = await h2.orch.sandboxes.create(CreateRequest(template_id="first"))
        assert read_file(h2, child.sandbox_id, "one.txt") == "1"
        await back_in_use(h2, r.sandbox_id)

    await _both(crash, h2, check)


async def test_kill_cut_is_finished(tmp_path: Path) -> None:
    h = await node(tmp_path)
    r = await h.orch.sandboxes.create(CreateRequest())
    other = await h.orch.sandboxes.create(CreateRequest())
    await h.orch.pauser.pause(other.sandbox_id)
    await h.orch.pauser.hibernate(other.sandbox_id)
    crash = Crash(h, "destroy")
    h2 = await crash.during(h.orch.sandboxes.kill(r.sandbox_id))

    async def check() -> None:
        assert [x.sandbox_id for x in h2.orch.table.list()] == [other.sandbox_id]
        assert all(x.sandbox_id != r.sandbox_id for x in h2.catalog.sandboxes())
        agrees(h2)
        await h2.orch.sandboxes.kill(other.sandbox_id)  # a paused one, its image with it
        assert list(h2.settings.images_dir.iterdir()) == []

    await _both(crash, h2, check)
