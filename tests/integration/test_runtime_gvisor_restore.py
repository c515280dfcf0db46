"""The gVisor backend's stopped sandboxes and recovery, against the real thing: stopping a
running sandbox keeps its files and address, destroying a stopped one releases its slot, a
failed restore keeps it, a reused container id falls back to a new one, restores in parallel;
and reconciling after a crash (own prefix, range and home), with and without upper dirs.

Needs root, runsc and busybox-static; the environment is tests/integration/gvisor_env.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest

from aenv.errors import RuntimeFailure
from aenv.runtime.base import Instance
from aenv.runtime.gvisor import GVisorRuntime
from aenv.runtime.net.network import SlotAddressing
from aenv.runtime.rootfs import mount_points
from tests.integration.gvisor_env import (
    RECONCILE_CIDR,
    RECONCILE_PREFIX,
    _pool_slots,
    assert_no_traces,
    crash,
    host_traces,
    make_settings,
    new_upper,
    rec,
    rootfs,
    runtime,
    rw_spec,
    slot_traces,
    spec,
    timed,
    upper_layer,
    work_dirs,
)
from tests.integration.gvisor_net import pool_full, sh, wait_http

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("runsc") is None or not Path("/bin/busybox").exists(),
        reason="needs root, runsc and busybox-static",
    ),
]

__all__ = ["rootfs", "runtime", "upper_layer"]  # fixtures used here, imported for pytest to find


async def test_stop_running_keeps_files_and_address(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path
) -> None:
    """Pause without memory: stop a running sandbox (processes dropped, files kept), then
    boot it again in the same slot on the same upper."""
    upper = new_upper(tmp_path, "u")
    inst = await runtime.create(rw_spec([rootfs], "nomem", upper))
    again = None
    try:
        await wait_http(inst)
        await sh(inst, "echo kept > /root/kept; echo gone > /tmp/gone")
        t0 = time.perf_counter()
        await runtime.stop(inst)
        timed("stop (running, kill)", time.perf_counter() - t0)
        await runtime.stop(inst)  # idempotent
        assert runtime.is_stopped(inst)
        with pytest.raises(RuntimeFailure):
            await runtime.freeze(inst)
        with pytest.raises(RuntimeFailure, match="belongs to sandbox"):
            await runtime.create(rw_spec([rootfs], "other", new_upper(tmp_path, "x")), reuse=inst)
        t0 = time.perf_counter()
        again = await runtime.create(rw_spec([rootfs], "nomem", upper), reuse=inst)
        await wait_http(again)
        timed("create (reuse) -> HTTP", time.perf_counter() - t0)
        assert (again.address, again.id) == (inst.address, inst.id)
        # Files kept, /tmp's too (it is the rootfs's own); memory not: a fresh boot.
        out = await sh(again, "cat /root/kept; cat /tmp/gone 2>&1")
        assert out.split() == ["kept", "gone"]
        # An image that looks whole, so that the refusal is about `reuse`.
        (tmp_path / "img").mkdir()
        (tmp_path / "img" / "checkpoint.img").write_bytes(b"x")
        with pytest.raises(RuntimeFailure, match="not a stopped"):
            await runtime.restore(rw_spec([rootfs], "nomem", upper), tmp_path / "img", reuse=again)
    finally:
        await runtime.destroy(again or inst)
    await runtime.wait_idle()
    assert slot_traces(runtime.settings, rec(inst).slot) == [] or rec(inst).slot in _pool_slots(
        runtime
    )
    assert mount_points(runtime.settings.sandboxes_dir) == []
    assert (upper / "root" / "kept").exists()


async def test_stopped_destroy_releases_slot(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path
) -> None:
    upper = new_upper(tmp_path, "u")
    inst = await runtime.create(rw_spec([rootfs], "stopdel", upper))
    await wait_http(inst)
    await runtime.checkpoint(inst, tmp_path / "img", leave_running=False)
    await runtime.stop(inst)
    assert slot_traces(runtime.settings, rec(inst).slot) != []
    assert rec(inst).bundle_dir.is_dir()
    await runtime.destroy(inst)
    await runtime.wait_idle()
    assert slot_traces(runtime.settings, rec(inst).slot) == [] or rec(inst).slot in _pool_slots(
        runtime
    )
    assert not rec(inst).bundle_dir.exists()
    assert inst.id not in host_traces(runtime.settings)["containers"]


async def test_failed_restore_keeps_stopped_slot(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path
) -> None:
    upper = new_upper(tmp_path, "u")
    inst = await runtime.create(rw_spec([rootfs], "refail", upper))
    try:
        await wait_http(inst)
        await runtime.checkpoint(inst, tmp_path / "img", leave_running=False)
        await runtime.stop(inst)
        (tmp_path / "bad-image").mkdir()
        u1 = new_upper(tmp_path, "u1")
        with pytest.raises(RuntimeFailure):
            await runtime.restore(
                rw_spec([rootfs], "refail", u1), tmp_path / "bad-image", reuse=inst
            )
        await runtime.wait_idle()
        # Still stopped, slot kept, nothing mounted: the caller can retry.
        assert runtime.is_stopped(inst) and slot_traces(runtime.settings, rec(inst).slot) != []
        assert mount_points(runtime.settings.sandboxes_dir) == []
        assert work_dirs(tmp_path) == []
        sealed = tmp_path / "s1"
        os.rename(upper, sealed)
        again = await runtime.restore(
            rw_spec([sealed, rootfs], "refail", u1), tmp_path / "img", reuse=inst
        )
        await wait_http(again)
        assert again.address == inst.address
        inst = again
    finally:
        await runtime.destroy(inst)


async def test_reuse_falls_back_to_a_new_container_id(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the stopped container's id is not free (its delete failed), the sandbox starts
    under a new id, still in its own slot (same address), and the old bundle goes."""
    upper = new_upper(tmp_path, "u")
    inst = await runtime.create(rw_spec([rootfs], "newid", upper))
    again = None
    try:
        await wait_http(inst)
        await runtime.stop(inst)
        real = runtime.runsc.sandbox_state_file
        taken = tmp_path / "taken.state"
        monkeypatch.setattr(
            runtime.runsc,
            "sandbox_state_file",
            lambda cid: taken if cid == inst.id else real(cid),
        )
        again = await runtime.create(rw_spec([rootfs], "newid", upper), reuse=inst)
        await wait_http(again)
        assert again.id != inst.id
        assert (again.address, rec(again).slot) == (inst.address, rec(inst).slot)
        await runtime.wait_idle()
        assert not rec(inst).bundle_dir.exists() and rec(again).bundle_dir.is_dir()
    finally:
        monkeypatch.undo()
        await runtime.destroy(again or inst)
    await runtime.wait_idle()
    assert mount_points(runtime.settings.sandboxes_dir) == []


async def _restore_many(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path, image: Path, n: int, tag: str
) -> None:
    uppers = [new_upper(tmp_path, f"{tag}-{n}-{i}") for i in range(n)]
    t0 = time.perf_counter()
    each: list[float] = []

    async def one(i: int) -> Instance:
        inst = await runtime.restore(rw_spec([rootfs], f"par{tag}{n}-{i}", uppers[i]), image)
        await wait_http(inst, limit=120)
        each.append(time.perf_counter() - t0)
        return inst

    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    insts = [r for r in results if isinstance(r, Instance)]
    try:
        assert len(insts) == n, [r for r in results if not isinstance(r, Instance)]
        timed(f"{n:>2} parallel restores -> all HTTP", time.perf_counter() - t0)
        timed(f"{n:>2} parallel restores: median child", sorted(each)[len(each) // 2])
    finally:
        await asyncio.gather(*(runtime.destroy(i) for i in insts))
        await runtime.wait_idle()


@pytest.mark.parametrize(
    "n",
    [
        1,
        4,
        pytest.param(
            16,
            marks=pytest.mark.skipif(
                not os.environ.get("AENV_RUNTIME_BENCH"), reason="AENV_RUNTIME_BENCH=1"
            ),
        ),
    ],
)
async def test_parallel_restores(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path, n: int
) -> None:
    upper = new_upper(tmp_path, "parent")
    parent = await runtime.create(rw_spec([rootfs], f"parp{n}", upper))
    try:
        await wait_http(parent)
        await runtime.checkpoint(parent, tmp_path / "img", leave_running=True)
    finally:
        await runtime.destroy(parent)
    await runtime.wait_idle()
    await pool_full(runtime)
    await _restore_many(runtime, rootfs, tmp_path, tmp_path / "img", n, "p")


# Reconcile after a crash (own prefix, range and home) -----------------------------------------


async def test_reconcile_after_crash(
    rootfs: Path, upper_layer: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    settings = make_settings(
        tmp_path_factory.mktemp("aenv-home-rc"), RECONCILE_PREFIX, RECONCILE_CIDR, pool=1
    )
    try:
        rt1 = GVisorRuntime(settings)
        await rt1.start(set())
        keep = await rt1.create(spec([upper_layer, rootfs], "rc-keep"))
        drop = await rt1.create(spec([rootfs], "rc-drop"))
        await asyncio.gather(wait_http(keep), wait_http(drop))
        await sh(keep, "echo state > /tmp/state")
        await pool_full(rt1)  # the crash leaves a ready pool slot behind
        crash(rt1)
        del rt1

        rt2 = GVisorRuntime(settings)
        recovered = await rt2.start({keep.id, "ghost-0000"})
        assert set(recovered) == {keep.id}
        back = recovered[keep.id]
        assert (back.address, rec(back).slot, rec(back).bundle_dir) == (
            keep.address,
            rec(keep).slot,
            rec(keep).bundle_dir,
        )
        assert await rt2.alive(back)
        assert "state" in await sh(back, "cat /tmp/state")
        assert not await rt2.alive(drop)
        await rt2.close()  # the pool's slots go; the recovered sandbox stays
        traces = host_traces(settings)
        assert traces["containers"] == [keep.id]
        addr = SlotAddressing.from_settings(settings)
        assert traces["netns"] == sorted(
            [addr.router_ns(rec(keep).slot), addr.inner_ns(rec(keep).slot)]
        )
        assert traces["links"] == [addr.host_if(rec(keep).slot)]
        assert not rec(drop).bundle_dir.exists() and rec(keep).bundle_dir.exists()
        mnt = settings.home / "mnt"
        assert traces["mounts"] == [str(mnt / str(rec(keep).rootfs_key))]
        crash(rt2)
        del rt2

        # Another crash, and now the catalog knows nothing: everything goes.
        rt3 = GVisorRuntime(settings)
        assert await rt3.start(set()) == {}
        await rt3.close()
        traces = host_traces(settings)
        for k in ("containers", "netns", "links", "mounts", "cgroups"):
            assert traces[k] == [], (k, traces)
        assert not any(settings.sandboxes_dir.iterdir())
        # A recovered instance can be destroyed by the new runtime.
        rt4 = GVisorRuntime(settings)
        await rt4.start(set())
        inst = await rt4.create(spec([rootfs], "rc-again"))
        await wait_http(inst)
        crash(rt4)
        rt5 = GVisorRuntime(settings)
        rec5 = await rt5.start({inst.id})
        await rt5.destroy(rec5[inst.id])
        await rt5.close()
        assert slot_traces(settings, rec(inst).slot) == []
        assert host_traces(settings)["containers"] == []
    finally:
        await GVisorRuntime(settings).purge()
        assert_no_traces(settings)


async def test_reconcile_with_overlays(
    rootfs: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """After a crash: a kept running sandbox keeps its overlay mount (re-adopted), a kept
    stopped one keeps its slot and can be restored into it, the rest is cleaned up; no
    upper dir is ever deleted."""
    settings = make_settings(
        tmp_path_factory.mktemp("aenv-home-rco"), RECONCILE_PREFIX, RECONCILE_CIDR, pool=1
    )
    try:
        rt1 = GVisorRuntime(settings)
        await rt1.start(set())
        ua, ub, uc = (new_upper(tmp_path, n) for n in ("a", "b", "c"))
        a, b, c = await asyncio.gather(
            rt1.create(rw_spec([rootfs], "rco-a", ua)),
            rt1.create(rw_spec([rootfs], "rco-b", ub)),
            rt1.create(rw_spec([rootfs], "rco-c", uc)),
        )
        await asyncio.gather(wait_http(a), wait_http(b), wait_http(c))
        for x in (a, b, c):
            await sh(x, f"echo {x.sandbox_id} > /root/mine")
        await rt1.checkpoint(c, tmp_path / "img-c", leave_running=False)
        await rt1.stop(c)
        crash(rt1)
        del rt1

        rt2 = GVisorRuntime(settings)
        recovered = await rt2.start({a.id, c.id})
        assert set(recovered) == {a.id, c.id}
        ra, rc = recovered[a.id], recovered[c.id]
        assert not rt2.is_stopped(ra) and rt2.is_stopped(rc)
        assert await rt2.alive(ra) and not await rt2.alive(rc)
        # a: still on its mounted overlay, writing to its upper.
        assert rec(ra).bundle_dir / "rootfs" in mount_points(settings.home)
        await sh(ra, "echo after > /root/after")
        assert (ua / "root" / "after").read_text() == "after\n"
        # b: container, mount and work dir gone; its upper stays.
        assert b.id not in host_traces(settings)["containers"]
        assert rec(b).bundle_dir / "rootfs" not in mount_points(settings.home)
        assert not (tmp_path / "uppers" / f"work-{b.id}").exists()
        assert (ub / "root" / "mine").read_text() == "rco-b\n"
        assert slot_traces(settings, rec(b).slot) == [] or rec(b).slot in _pool_slots(rt2)
        # c: restored into its kept slot on a sealed stack.
        assert slot_traces(settings, rec(c).slot) != []
        sealed = tmp_path / "sealed-c"
        os.rename(uc, sealed)
        rc2 = await rt2.restore(
            rw_spec([sealed, rootfs], "rco-c", new_upper(tmp_path, "c1")),
            tmp_path / "img-c",
            reuse=rc,
        )
        await wait_http(rc2)
        assert (rc2.address, rc2.id) == (c.address, c.id)
        assert "rco-c" in await sh(rc2, "cat /root/mine")
        await asyncio.gather(rt2.destroy(ra), rt2.destroy(rc2))
        await rt2.close()
        traces = host_traces(settings)
        for k in ("containers", "netns", "links", "mounts", "cgroups"):
            assert traces[k] == [], (k, traces)
        assert work_dirs(tmp_path) == []
    finally:
        await GVisorRuntime(settings).purge()
        assert_no_traces(settings)
    assert all(u.is_dir() for u in (ua, ub))
