"""The gVisor backend against the real thing (runsc, network namespaces, iptables, overlayfs):
sandboxes created and served, isolated from each other and from the host's services, frozen
and thawed, checkpointed, restored and forked, destroyed without a trace; shared read-only
layers, cgroup limits, the slot pool, failed creates and restores, concurrent creates.

Needs root, runsc (20240729+) and busybox-static. Uses its own net prefix/range and a temporary
AENV_HOME, and removes everything it made (by prefix and root dir) even when a test fails
(tests/integration/gvisor_env.py; talking to the sandboxes: gvisor_net.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from aenv.errors import RuntimeFailure
from aenv.runtime.base import Instance, SandboxSpec
from aenv.runtime.gvisor import GVisorRuntime
from aenv.runtime.net.network import SlotAddressing
from aenv.runtime.rootfs import mount_points
from tests.integration.gvisor_env import (
    CIDR,
    PORT,
    PREFIX,
    TIMINGS,
    MiB,
    _pool_slots,
    host_traces,
    rec,
    rootfs,
    runtime,
    slot_traces,
    spec,
    timed,
    tree_digest,
    upper_layer,
)
from tests.integration.gvisor_net import (
    cgroups_of,
    client,
    counter,
    counter_past,
    ext_server,
    get,
    host_addresses,
    host_nc,
    host_servers,
    pool_full,
    probe,
    sh,
    top_level_entries,
    wait_http,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("runsc") is None or not Path("/bin/busybox").exists(),
        reason="needs root, runsc and busybox-static",
    ),
]

__all__ = [
    "ext_server",
    "host_servers",
    "rootfs",
    "runtime",
    "upper_layer",
]  # fixtures used here, imported for pytest to find


# Tests ------------------------------------------------------------------------------------------


async def test_create_serves_http(runtime: GVisorRuntime, rootfs: Path) -> None:
    await pool_full(runtime)  # this measures a pooled acquire
    t0 = time.perf_counter()
    inst = await runtime.create(spec([rootfs], "http1", hostname="box1"))
    timed("create (pooled slot)", time.perf_counter() - t0)
    try:
        timed("create -> HTTP answers", time.perf_counter() - t0)
        TIMINGS["create -> HTTP answers"][-1] += await wait_http(inst) * 1000
        assert inst.address == SlotAddressing(PREFIX, CIDR).router_ip(rec(inst).slot)
        assert "hello from aenv" in await get(inst)
        assert await runtime.alive(inst)
        out = await sh(inst, "ifconfig eth0; hostname; id -u")
        assert "169.254.0.21" in out and "box1" in out
        stats = await runtime.stats(inst)
        assert stats.mem_total_bytes == 256 * MiB
        assert 0 < stats.mem_used_bytes < 256 * MiB
        assert stats.rss_bytes > 0
        assert 0 <= stats.cpu_used_pct <= 100
        # Every port is reachable: httpd on a second port started from inside.
        await sh(inst, "httpd -p 8081 -h /www")
        async with client(10) as c:
            r = await c.get(f"http://{inst.address}:8081/index.html")
            assert r.status_code == 200
    finally:
        await runtime.destroy(inst)


async def test_sandboxes_are_isolated_from_each_other(runtime: GVisorRuntime, rootfs: Path) -> None:
    a, b = await asyncio.gather(
        runtime.create(spec([rootfs], "iso-a")), runtime.create(spec([rootfs], "iso-b"))
    )
    try:
        await asyncio.gather(wait_http(a), wait_http(b))
        assert a.address != b.address and rec(a).slot != rec(b).slot
        await sh(a, "echo secret-a > /tmp/secret; echo rootfs-a > /etc/secret")
        out = await sh(b, "cat /tmp/secret /etc/secret; echo end")
        assert "secret-a" not in out and "rootfs-a" not in out
        addr = SlotAddressing(PREFIX, CIDR)
        res = await probe(
            a,
            [
                ("127.0.0.1", PORT),  # its own httpd: the probe itself works
                (b.address, PORT),  # the other sandbox's address
                (addr.host_ip(rec(b).slot), PORT),  # the host side of the other's slot
            ],
        )
        assert res == {
            ("127.0.0.1", PORT): True,
            (b.address, PORT): False,
            (addr.host_ip(rec(b).slot), PORT): False,
        }
        # The node still reaches both.
        assert "hello" in await get(a) and "hello" in await get(b)
    finally:
        await asyncio.gather(runtime.destroy(a), runtime.destroy(b))


async def test_sandbox_cannot_reach_host_services(
    runtime: GVisorRuntime,
    rootfs: Path,
    host_servers: tuple[int, int],
    ext_server: tuple[str, int],
) -> None:
    public_port, local_port = host_servers
    inst = await runtime.create(spec([rootfs], "iso-host"))
    try:
        await wait_http(inst)
        addr = SlotAddressing(PREFIX, CIDR)
        own_host_ip = addr.host_ip(rec(inst).slot)
        targets = [(own_host_ip, public_port), (own_host_ip, local_port)]
        targets += [(ip, public_port) for ip in host_addresses()]
        targets += [("127.0.0.1", local_port), (ext_server[0], ext_server[1])]
        # Sanity: from the host, the 0.0.0.0 server answers on each of these addresses.
        for ip in [own_host_ip, *host_addresses()]:
            assert b"HTTP/1.0 200" in await asyncio.to_thread(host_nc, ip, public_port), ip
        res = await probe(inst, targets)
        assert res.pop(ext_server) is True, "egress to a non-host address must work"
        assert not any(res.values()), res
    finally:
        await runtime.destroy(inst)


async def test_freeze_thaw(runtime: GVisorRuntime, rootfs: Path) -> None:
    inst = await runtime.create(spec([rootfs], "freeze"))
    try:
        await wait_http(inst)
        before = await counter(inst)
        t0 = time.perf_counter()
        await runtime.freeze(inst)
        timed("freeze", time.perf_counter() - t0)
        assert await runtime.alive(inst)
        # No answer: usually a timeout; under heavy host load the sentry's netstack (which
        # keeps running while the tasks are paused) may also drop the connection.
        with pytest.raises((httpx.TimeoutException, httpx.RemoteProtocolError)):
            await get(inst, "/tmp/counter", timeout=0.5)
        t0 = time.perf_counter()
        await runtime.thaw(inst)
        timed("thaw", time.perf_counter() - t0)
        after = await counter(inst)
        assert after >= before
        await counter_past(inst, after)  # it goes on
    finally:
        await runtime.destroy(inst)


async def test_checkpoint_and_fork(runtime: GVisorRuntime, rootfs: Path, tmp_path: Path) -> None:
    before_layer = tree_digest(rootfs)
    parent = await runtime.create(spec([rootfs], "fork-p"))
    children: list[Instance] = []
    try:
        await wait_http(parent)
        await sh(parent, "echo before > /tmp/marker; echo rootfs > /etc/marker")
        # The counter has run a while: a child that started it again from 0 would be behind.
        await counter_past(parent, 10)
        image = tmp_path / "image"
        t0 = time.perf_counter()
        await runtime.checkpoint(parent, image, leave_running=True)
        timed("checkpoint --leave-running", time.perf_counter() - t0)
        at_checkpoint = await counter(parent)
        assert any(image.iterdir())
        for i in range(2):
            t0 = time.perf_counter()
            child = await runtime.restore(spec([rootfs], f"fork-c{i}"), image)
            timed("restore", time.perf_counter() - t0)
            children.append(child)
            t1 = time.perf_counter()
            await wait_http(child)
            timed("restore -> HTTP answers", time.perf_counter() - t0)
            timed("  (HTTP wait after restore)", time.perf_counter() - t1)
        assert len({parent.address, *(c.address for c in children)}) == 3
        for child in children:
            out = await sh(child, "cat /tmp/marker /etc/marker")
            assert "before" in out and "rootfs" in out
            n = await counter(child)
            # Memory state came along: the counter goes on from the checkpoint, not from 0.
            assert n >= at_checkpoint - 5
        # Each continues on its own, and so does the parent.
        await sh(children[0], "echo only-c0 > /tmp/own")
        out = await sh(children[1], "cat /tmp/own; echo end")
        assert "only-c0" not in out
        assert "only-c0" not in await sh(parent, "cat /tmp/own; echo end")
        values = [await counter(x) for x in (parent, *children)]
        for x, value in zip((parent, *children), values, strict=True):
            await counter_past(x, value)
        # The layer directory was never written (writes live in the sentry's memory overlay).
        assert tree_digest(rootfs) == before_layer
        assert not any(p.name.startswith(".gvisor") for p in top_level_entries(rootfs))
    finally:
        await asyncio.gather(*(runtime.destroy(x) for x in (parent, *children)))


async def test_checkpoint_stops_sandbox_and_restores(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path
) -> None:
    """Hibernate: freeze, checkpoint without leave_running, restore later."""
    inst = await runtime.create(spec([rootfs], "hib"))
    child = None
    try:
        await wait_http(inst)
        await sh(inst, "echo kept > /tmp/kept")
        await runtime.freeze(inst)
        t0 = time.perf_counter()
        await runtime.checkpoint(inst, tmp_path / "img", leave_running=False)
        timed("checkpoint (stops)", time.perf_counter() - t0)
        assert not await runtime.alive(inst)
        await runtime.destroy(inst)
        t0 = time.perf_counter()
        child = await runtime.restore(spec([rootfs], "hib"), tmp_path / "img")
        timed("restore (of hibernated)", time.perf_counter() - t0)
        # Restored as it was: paused. Thaw it.
        if not await _answers(child):
            await runtime.thaw(child)
        await wait_http(child)
        assert "kept" in await sh(child, "cat /tmp/kept")
    finally:
        await runtime.destroy(inst)
        if child is not None:
            await runtime.destroy(child)


async def _answers(inst: Instance) -> bool:
    try:
        await get(inst, timeout=1.0)
        return True
    except httpx.HTTPError:
        return False


async def test_destroy_leaves_nothing(
    runtime: GVisorRuntime, rootfs: Path, upper_layer: Path
) -> None:
    settings = runtime.settings
    inst = await runtime.create(spec([upper_layer, rootfs], "gone"))
    await wait_http(inst)
    key = rec(inst).rootfs_key
    assert key and (settings.home / "mnt" / key) in mount_points(settings.home)
    t0 = time.perf_counter()
    await runtime.destroy(inst)
    timed("destroy (awaited part)", time.perf_counter() - t0)
    assert not await runtime.alive(inst)
    t0 = time.perf_counter()
    await runtime.wait_idle()
    timed("destroy (background part)", time.perf_counter() - t0)
    await runtime.destroy(inst)  # idempotent
    await runtime.wait_idle()
    assert slot_traces(settings, rec(inst).slot) == [] or rec(inst).slot in _pool_slots(runtime)
    assert inst.id not in host_traces(settings)["containers"]
    assert not rec(inst).bundle_dir.exists()
    assert (settings.home / "mnt" / key) not in mount_points(settings.home)
    assert not cgroups_of(inst.id)


async def test_layer_stack_is_shared_and_read_only(
    runtime: GVisorRuntime, rootfs: Path, upper_layer: Path
) -> None:
    settings = runtime.settings
    before = (tree_digest(rootfs), tree_digest(upper_layer))
    a, b = await asyncio.gather(
        runtime.create(spec([upper_layer, rootfs], "ml-a")),
        runtime.create(spec([upper_layer, rootfs], "ml-b")),
    )
    try:
        await asyncio.gather(wait_http(a), wait_http(b))
        key = rec(a).rootfs_key
        assert key is not None and key == rec(b).rootfs_key
        mnt = settings.home / "mnt" / key
        assert mount_points(settings.home).count(mnt) == 1
        assert "upper layer" in await get(a, "/www/extra.html")
        assert "hello" in await get(a, "/www/index.html")
        await sh(a, "echo changed > /www/extra.html; rm /etc/passwd; echo new > /newfile")
        assert "changed" in await get(a, "/www/extra.html")
        assert "upper layer" in await get(b, "/www/extra.html")
        assert "root:x" in await sh(b, "cat /etc/passwd")
        assert (tree_digest(rootfs), tree_digest(upper_layer)) == before
        await runtime.destroy(a)
        await runtime.wait_idle()
        assert mnt in mount_points(settings.home)  # b still uses it
        assert "upper layer" in await get(b, "/www/extra.html")
    finally:
        await asyncio.gather(runtime.destroy(a), runtime.destroy(b))
    await runtime.wait_idle()
    assert mnt not in mount_points(settings.home)


async def test_cgroup_limits(runtime: GVisorRuntime, rootfs: Path) -> None:
    inst = await runtime.create(spec([rootfs], "limits", cpu_count=1, memory_mb=128))
    other = await runtime.create(spec([rootfs], "bystander"))
    try:
        await asyncio.gather(wait_http(inst), wait_http(other))
        cg = f"{PREFIX}/{inst.id}"
        mem = Path("/sys/fs/cgroup/memory", cg)
        cpu = Path("/sys/fs/cgroup/cpu", cg)
        assert int((mem / "memory.limit_in_bytes").read_text()) == 128 * MiB
        assert int((cpu / "cpu.cfs_quota_us").read_text()) == 100_000
        assert int((cpu / "cpu.cfs_period_us").read_text()) == 100_000
        out = (await sh(inst, "nproc; free -m | grep Mem")).split()
        # runsc --cpu-num-from-quota: ceil(quota), but never below 2.
        assert int(out[0]) == max(2, min(1, os.cpu_count() or 1))
        assert 120 <= int(out[2]) <= 128, out
        # A memory hog: the sandbox is OOM-killed inside its own cgroup, nothing else is.
        with contextlib.suppress(httpx.HTTPError):
            await sh(inst, "dd if=/dev/zero of=/tmp/big bs=1M count=400", timeout=30)
        for _ in range(100):
            if not await runtime.alive(inst):
                break
            await asyncio.sleep(0.1)
        assert not await runtime.alive(inst)
        oom = dict(line.split() for line in (mem / "memory.oom_control").read_text().splitlines())
        assert int(oom["oom_kill"]) >= 1
        assert await runtime.alive(other) and "hello" in await get(other)
    finally:
        await asyncio.gather(runtime.destroy(inst), runtime.destroy(other))


async def test_slot_pool(runtime: GVisorRuntime) -> None:
    pool = runtime.pool
    await pool_full(runtime)
    assert pool.ready == pool.size
    t0 = time.perf_counter()
    slot = await pool.acquire()
    timed("slot acquire (pooled)", time.perf_counter() - t0)
    await pool.release(slot)
    t0 = time.perf_counter()
    n = runtime.addressing.capacity - 1  # the last slot: the longest names, the last addresses
    built = await runtime.network.build(n)
    timed("slot setup (build)", time.perf_counter() - t0)
    try:
        assert built.router_ip == SlotAddressing(PREFIX, CIDR).router_ip(n)
        cmd = ["ip", "-n", built.inner_ns, "-j", "addr", "show", "eth0"]
        r = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True)
        assert "169.254.0.21" in r.stdout
    finally:
        t0 = time.perf_counter()
        await runtime.network.teardown(n)
        timed("slot teardown", time.perf_counter() - t0)
    assert slot_traces(runtime.settings, n) == []


async def test_failed_create_and_restore_leave_nothing(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path
) -> None:
    settings = runtime.settings
    await runtime.wait_idle()
    before = host_traces(settings)
    with pytest.raises(RuntimeFailure, match="no-such-binary"):
        await runtime.create(
            SandboxSpec(sandbox_id="bad", layers=[rootfs], args=["/no-such-binary"])
        )
    (tmp_path / "empty-image").mkdir()
    with pytest.raises(RuntimeFailure):
        await runtime.restore(spec([rootfs], "bad2"), tmp_path / "empty-image")
    with pytest.raises(RuntimeFailure):
        await runtime.restore(spec([rootfs], "bad3"), tmp_path / "missing")
    await runtime.wait_idle()
    await pool_full(runtime)  # it refilled what was taken: no slot half-built
    after = host_traces(settings)
    assert after["containers"] == before["containers"] == []
    assert not (settings.sandboxes_dir / "bad").exists()
    assert set(after["netns"]) <= set(before["netns"]) | {
        ns for s in runtime.pool._ready for ns in (s.router_ns, s.inner_ns)
    }


async def test_concurrent_creates(runtime: GVisorRuntime, rootfs: Path) -> None:
    t0 = time.perf_counter()
    insts = await asyncio.gather(*(runtime.create(spec([rootfs], f"many{i}")) for i in range(4)))
    try:
        await asyncio.gather(*(wait_http(i) for i in insts))
        timed("4 concurrent creates -> HTTP", time.perf_counter() - t0)
        assert len({i.address for i in insts}) == 4
        assert len({rec(i).slot for i in insts}) == 4
    finally:
        await asyncio.gather(*(runtime.destroy(i) for i in insts))
