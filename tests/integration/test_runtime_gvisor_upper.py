"""The gVisor backend's writable host overlays (spec.upper), against the real thing: a sandbox's
writes land in its upper dir on the host (and /tmp with them), a checkpoint re-stacked under
forks (also with 1 GiB written), and the memory overlay's cost for comparison.

Needs root, runsc and busybox-static; the environment is tests/integration/gvisor_env.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import time
from pathlib import Path

import pytest

from aenv.runtime.base import Instance
from aenv.runtime.gvisor import GVisorRuntime
from aenv.runtime.rootfs import mount_points
from tests.integration.gvisor_env import (
    INIT_RW,
    TIMINGS,
    MiB,
    _pool_slots,
    new_upper,
    rec,
    rootfs,
    runtime,
    rw_spec,
    slot_traces,
    spec,
    timed,
    tree_digest,
    upper_layer,
    work_dirs,
)
from tests.integration.gvisor_net import counter_past, read_ints, sh, wait_http

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("runsc") is None or not Path("/bin/busybox").exists(),
        reason="needs root, runsc and busybox-static",
    ),
]

__all__ = ["rootfs", "runtime", "upper_layer"]  # fixtures used here, imported for pytest to find


def write_random(mib: int) -> str:
    """A shell command writing `mib` MiB of incompressible, non-zero data to /root/big in one
    process (gVisor skips zero pages when it saves memory, and every process a sandbox has
    run adds to its checkpoint state, so neither would show what the rootfs costs)."""
    return f"dd if=/dev/urandom of=/root/big bs=1M count={mib} iflag=fullblock 2>/dev/null"


async def root_counter(inst: Instance) -> int:
    return (await read_ints(inst, "/root/counter"))[0]


def host_counter(upper: Path, *, wait: bool = True) -> int:
    """The counter file as the host sees it in an upper dir. The shell rewrites it (truncate,
    then write), so a read can come up empty: retried while the sandbox runs, 0 when it does
    not (a checkpoint between the two steps)."""
    path = upper / "root" / "counter"
    deadline = time.monotonic() + 2
    while True:
        text = path.read_text().strip()
        if text or not wait or time.monotonic() > deadline:
            return int(text or 0)
        time.sleep(0.01)


def file_mib(path: Path) -> float:
    return path.stat().st_size / MiB


async def test_upper_overlay_writes_land_in_upper(
    runtime: GVisorRuntime, rootfs: Path, upper_layer: Path, tmp_path: Path
) -> None:
    before = (tree_digest(rootfs), tree_digest(upper_layer))
    upper = new_upper(tmp_path, "u")
    inst = await runtime.create(rw_spec([upper_layer, rootfs], "rw", upper))
    try:
        await wait_http(inst)
        mnt = rec(inst).bundle_dir / "rootfs"
        assert mnt in mount_points(runtime.settings.home)
        assert (tmp_path / "uppers" / f"work-{inst.id}").is_dir()
        assert rec(inst).overlay == "none"
        await sh(
            inst,
            "dd if=/dev/zero of=/root/big bs=1M count=32 2>/dev/null; echo new > /newfile; "
            "rm /etc/hosts /etc/layer-marker; rm -rf /www; mkdir /www; "
            "echo x > /www/y; echo t > /tmp/in-tmp",
        )
        assert file_mib(upper / "root" / "big") == 32
        assert (upper / "newfile").read_text() == "new\n"
        # Deleted lower files: overlayfs whiteouts (0/0 character devices).
        for gone in (upper / "etc" / "hosts", upper / "etc" / "layer-marker"):
            st = gone.lstat()
            assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(0, 0), gone
        # A directory replaced by a new one: opaque.
        assert os.getxattr(upper / "www", "trusted.overlay.opaque") == b"y"
        assert sorted(p.name for p in (upper / "www").iterdir()) == ["y"]
        # /tmp is the rootfs's own (not runsc's in-memory tmpfs): in the upper dir too.
        assert (upper / "tmp" / "in-tmp").read_text() == "t\n"
        assert "t" in await sh(inst, "cat /tmp/in-tmp")
        assert (tree_digest(rootfs), tree_digest(upper_layer)) == before
    finally:
        await runtime.destroy(inst)
    await runtime.wait_idle()
    assert mnt not in mount_points(runtime.settings.home)
    assert work_dirs(tmp_path) == []
    assert not rec(inst).bundle_dir.exists()
    # The upper dir belongs to the caller: kept, with its content.
    assert file_mib(upper / "root" / "big") == 32


async def test_tmp_in_upper_when_image_tmp_is_not_empty(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path
) -> None:
    """A file in the image's /tmp stays visible, and new ones land in the upper dir."""
    layer = tmp_path / "keep-tmp"
    (layer / "tmp").mkdir(parents=True)
    (layer / "tmp" / ".keep").write_text("")
    upper = new_upper(tmp_path, "u")
    inst = await runtime.create(rw_spec([layer, rootfs], "rwtmp", upper))
    try:
        await wait_http(inst)
        await sh(inst, "echo t > /tmp/in-tmp")
        assert (upper / "tmp" / "in-tmp").read_text() == "t\n"
        assert "keep" in await sh(inst, "ls -a /tmp")
    finally:
        await runtime.destroy(inst)


async def _restack(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path, big_mb: int, tag: str
) -> None:
    """The re-stack flow the orchestrator drives for a snapshot with a host upper dir:
    checkpoint (stops) -> stop -> seal U0 into layer S -> restore the parent on [S, *old] with
    a new upper, in its own slot -> fork children from the same image."""
    old = [rootfs]
    u0 = new_upper(tmp_path, "u0")
    parent = await runtime.create(rw_spec(old, f"rs{tag}", u0, memory_mb=512))
    children: list[Instance] = []
    restored: Instance | None = None
    try:
        await wait_http(parent)
        t0 = time.perf_counter()
        await sh(parent, write_random(big_mb), 300)
        timed(f"restack {tag}: write {big_mb} MiB", time.perf_counter() - t0)
        await sh(parent, "echo parent > /etc/marker; rm /etc/hosts; echo t > /tmp/in-tmp")
        assert file_mib(u0 / "root" / "big") == big_mb
        # The counter has run a while: a restore that started it again would be behind.
        await counter_past(parent, 10)
        image = tmp_path / "image"
        slot, cid, address = rec(parent).slot, parent.id, parent.address

        t0 = time.perf_counter()
        await runtime.checkpoint(parent, image, leave_running=False)
        t1 = time.perf_counter()
        await runtime.stop(parent)
        t2 = time.perf_counter()
        assert runtime.is_stopped(parent) and not await runtime.alive(parent)
        assert rec(parent).bundle_dir / "rootfs" not in mount_points(runtime.settings.home)
        assert work_dirs(tmp_path) == []
        assert slot_traces(runtime.settings, slot) != []  # the slot is kept
        at_checkpoint = host_counter(u0, wait=False)
        # The orchestrator seals U0: a rename into a read-only layer, whatever its size.
        sealed = tmp_path / "layers" / "s1"
        sealed.parent.mkdir()
        os.rename(u0, sealed)
        t3 = time.perf_counter()
        sealed_digest = tree_digest(sealed)
        layers = [sealed, *old]
        u1 = new_upper(tmp_path, "u1")
        restored = await runtime.restore(rw_spec(layers, f"rs{tag}", u1), image, reuse=parent)
        t4 = time.perf_counter()
        await wait_http(restored)
        t5 = time.perf_counter()
        timed(f"restack {tag}: checkpoint (stops)", t1 - t0)
        timed(f"restack {tag}: stop", t2 - t1)
        timed(f"restack {tag}: seal (rename)", t3 - t2)
        timed(f"restack {tag}: restore (reuse)", t4 - t3)
        timed(f"restack {tag}: HTTP after restore", t5 - t4)
        timed(f"restack {tag}: parent downtime", t5 - t0)
        TIMINGS.setdefault(f"restack {tag}: image MiB", []).append(dir_mib(image))

        # Same sandbox, same place: address and slot. The container id is new: the old
        # container's `runsc delete` was left out of the stop and happens now, in the
        # background.
        assert (restored.address, rec(restored).slot) == (address, slot)
        assert restored.id != cid and restored.id.startswith(f"rs{tag}-")
        deadline = time.monotonic() + 30
        while runtime.runsc.sandbox_state_file(cid) is not None:
            assert time.monotonic() < deadline, "the old container was never deleted"
            await asyncio.sleep(0.1)
        # Both counters in one read, from the sealed layer + new upper; the process went on
        # from where it was.
        n, in_tmp = await read_ints(restored, "/root/counter", "/tmp/counter")
        assert n >= at_checkpoint, (n, at_checkpoint)
        assert abs(in_tmp - n) <= 1, (in_tmp, n)
        out = await sh(restored, "ls -l /root/big; cat /etc/marker /tmp/in-tmp; cat /etc/hosts")
        assert str(big_mb * MiB) in out and "parent" in out and "t\n" in out
        assert "No such file" in out  # the whiteout in the sealed layer still hides it
        await counter_past(restored, n, root_counter)
        # New writes (the counter) go to the new upper, not to the sealed layer.
        assert host_counter(u1) > at_checkpoint
        assert not (u1 / "root" / "big").exists()

        # Fork: children from the same image, each on its own upper over the same stack.
        t0 = time.perf_counter()
        uppers = [new_upper(tmp_path, f"c{i}") for i in range(2)]
        children = list(
            await asyncio.gather(
                *(
                    runtime.restore(rw_spec(layers, f"rs{tag}-c{i}", u), image)
                    for i, u in enumerate(uppers)
                )
            )
        )
        await asyncio.gather(*(wait_http(c) for c in children))
        timed(f"restack {tag}: 2 children -> HTTP", time.perf_counter() - t0)
        assert len({restored.address, *(c.address for c in children)}) == 3
        for i, c in enumerate(children):
            assert await root_counter(c) >= at_checkpoint
            await sh(c, f"echo only-c{i} > /root/own")
            assert (uppers[i] / "root" / "own").read_text() == f"only-c{i}\n"
        # A file written in one is visible neither in the other nor in the parent.
        assert "only-c1" not in await sh(children[0], "cat /root/own")
        assert "only-c0" not in await sh(children[1], "cat /root/own")
        assert "only-c" not in await sh(restored, "cat /root/own 2>&1; echo end")
        values = [await root_counter(x) for x in (restored, *children)]
        for x, value in zip((restored, *children), values, strict=True):
            await counter_past(x, value, root_counter)
        assert tree_digest(sealed) == sealed_digest  # the sealed layer is never written
    finally:
        await asyncio.gather(
            *(runtime.destroy(x) for x in (parent, restored, *children) if x is not None)
        )
    await runtime.wait_idle()
    assert mount_points(runtime.settings.sandboxes_dir) == []
    assert work_dirs(tmp_path) == []
    assert slot_traces(runtime.settings, slot) == [] or slot in _pool_slots(runtime)


def dir_mib(path: Path) -> float:
    """Size of the files below `path` (apparent size: an image file may be sparse)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / MiB


async def test_restack_fork(runtime: GVisorRuntime, rootfs: Path, tmp_path: Path) -> None:
    await _restack(runtime, rootfs, tmp_path, big_mb=64, tag="64M")


@pytest.mark.skipif(not os.environ.get("AENV_RUNTIME_BENCH"), reason="AENV_RUNTIME_BENCH=1")
async def test_restack_fork_1gib(runtime: GVisorRuntime, rootfs: Path, tmp_path: Path) -> None:
    """The seal is a rename and the image does not carry the rootfs: neither grows."""
    await _restack(runtime, rootfs, tmp_path, big_mb=1024, tag="1G")


@pytest.mark.skipif(not os.environ.get("AENV_RUNTIME_BENCH"), reason="AENV_RUNTIME_BENCH=1")
async def test_memory_overlay_1gib_for_comparison(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path
) -> None:
    """The same 1 GiB written with --overlay2=root:memory: it is in every checkpoint."""
    inst = await runtime.create(spec([rootfs], "mem1g", args=INIT_RW, memory_mb=2048))
    child = None
    try:
        await wait_http(inst)
        await sh(inst, write_random(1024), 300)
        image = tmp_path / "image"
        t0 = time.perf_counter()
        await runtime.checkpoint(inst, image, leave_running=False)
        t1 = time.perf_counter()
        await runtime.stop(inst)
        t2 = time.perf_counter()
        child = await runtime.restore(
            spec([rootfs], "mem1g", args=INIT_RW, memory_mb=2048), image, reuse=inst
        )
        t3 = time.perf_counter()
        await wait_http(child)
        t4 = time.perf_counter()
        assert str(1024 * MiB) in await sh(child, "ls -l /root/big")
        timed("root:memory 1G: checkpoint (stops)", t1 - t0)
        timed("root:memory 1G: stop", t2 - t1)
        timed("root:memory 1G: restore (reuse)", t3 - t2)
        timed("root:memory 1G: HTTP after restore", t4 - t3)
        timed("root:memory 1G: downtime", t4 - t0)
        TIMINGS.setdefault("root:memory 1G: image MiB", []).append(dir_mib(image))
    finally:
        await runtime.destroy(inst)
        if child is not None:
            await runtime.destroy(child)
