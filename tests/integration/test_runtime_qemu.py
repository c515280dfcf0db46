"""The runtime contract against the QEMU backend: real microVM guests (TCG-emulated on hosts
whose KVM cannot boot a standard guest), the same busybox sandboxes as the gVisor contract
(an httpd in the guest at the slot's address), their own net prefixes and homes; every
trace is removed at the end."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from aenv.config import Settings
from aenv.runtime.base import Instance, Runtime
from aenv.runtime.qemu import QemuRuntime
from aenv.runtime.qemu.machine import Machine
from tests import netplan
from tests.contract.runtime_contract import RuntimeContract, Specs

from .gvisor_env import INIT, make_rootfs
from .gvisor_net import read_ints, sh, wait_http
from .qemu_env import assert_no_traces, make_settings, missing, started_runtime

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(missing() is not None, reason=missing() or ""),
]

PREFIX, CIDR = netplan.slot_net("qco").prefix, netplan.slot_net("qco").cidr
RESTART_PREFIX, RESTART_CIDR = netplan.slot_net("qcr").prefix, netplan.slot_net("qcr").cidr
# A TCG guest boots in seconds, not milliseconds.
BOOT_LIMIT = 90.0


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_rootfs(tmp_path_factory.mktemp("qemu-layer"))


@pytest.fixture
def specs(rootfs: Path, tmp_path: Path) -> Specs:
    return Specs(layers=[rootfs], args=INIT, uppers=tmp_path / "uppers", memory_mb=192)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[QemuRuntime]:
    async with started_runtime(tmp_path_factory.mktemp("qemu-home"), PREFIX, CIDR) as rt:
        yield rt


class QemuRuntimes:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.used = False

    def new(self) -> Runtime:
        self.used = True
        return QemuRuntime(self.settings)

    async def crash(self, rt: Runtime) -> None:
        assert isinstance(rt, QemuRuntime)
        rt._started = False  # its VMs go on, as a killed server's would
        await rt.pool.close()
        await rt.network.close()


@pytest_asyncio.fixture(loop_scope="module")
async def runtimes(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[QemuRuntimes]:
    settings = make_settings(
        tmp_path_factory.mktemp("qemu-home-rs"), RESTART_PREFIX, RESTART_CIDR, pool=1
    )
    made = QemuRuntimes(settings)
    yield made
    if made.used:
        await QemuRuntime(settings).purge()
        assert_no_traces(settings)


class TestQemuRuntime(RuntimeContract):
    async def ready(self, runtime: Runtime, inst: Instance) -> None:
        await wait_http(inst, limit=BOOT_LIMIT)


async def test_a_guest_is_a_vm_with_its_own_kernel_files_and_limits(
    runtime: QemuRuntime, specs: Specs
) -> None:
    """What the gVisor backend cannot give: the guest's own Linux kernel; and what a
    sandbox expects of any backend: its writes in its upper, its size, its entropy."""
    spec = specs("qm-vm", upper=True)
    spec.cpu_count, spec.memory_mb, spec.disk_mb = 2, 256, 64
    inst = await runtime.create(spec)
    try:
        await wait_http(inst, limit=BOOT_LIMIT)
        assert runtime.describe()["accelerator"] in ("kvm", "tcg")
        kernel = await sh(inst, "uname -r")
        assert kernel.strip() == runtime.boot.release if runtime.boot else False
        assert (await sh(inst, "grep -c ^processor /proc/cpuinfo")).strip() == "2"
        total_kb = int((await sh(inst, "awk '/MemTotal/{print $2}' /proc/meminfo")).strip())
        assert 150_000 < total_kb <= 256 * 1024
        await sh(inst, "echo hello > /root/note; sync")
        assert spec.upper is not None
        await sh(inst, "echo live > /root/live")  # not synced by the guest itself
        await runtime.sync_files(inst)
        assert (spec.upper / "root" / "live").read_text() == "live\n"
        assert await runtime.alive(inst) and not await runtime.is_frozen(inst)
        # A process that eats the guest's memory meets the guest's OOM killer; the rest
        # of the sandbox (its httpd, its counter) goes on.
        await sh(inst, "head -c 400m /dev/zero | tail > /dev/null; echo done")
        assert "Killed process" in await sh(inst, "dmesg | grep -i 'out of memory'")
        # Its writes are bounded by its disk's size.
        full = await sh(inst, "dd if=/dev/zero of=/root/big bs=1M count=100 2>&1; rm /root/big")
        assert "No space left on device" in full, full
        a = await read_ints(inst, "/tmp/counter")
        b = await read_ints(inst, "/tmp/counter")
        assert b[0] >= a[0]
        await runtime.stop(inst)
        assert spec.upper is not None
        assert (spec.upper / "root" / "note").read_text() == "hello\n"
    finally:
        await runtime.destroy(inst)


async def test_fork_children_share_the_parents_memory_file_copy_on_write(
    runtime: QemuRuntime, specs: Specs, tmp_path: Path
) -> None:
    parent = await runtime.create(specs("qm-par", upper=True))
    kids: list[Instance] = []
    try:
        await wait_http(parent, limit=BOOT_LIMIT)
        await sh(parent, "echo parent > /root/who")
        image = tmp_path / "fork"
        await runtime.checkpoint(parent, image, leave_running=True)
        for i in range(2):
            kids.append(await runtime.restore(specs(f"qm-kid{i}", upper=True), image))
        seeds = set()
        for i, kid in enumerate(kids):
            await wait_http(kid, limit=BOOT_LIMIT)
            m = Machine.of(kid)
            assert m.ram == image / "memory" and not m.ram_shared  # mapped, not copied
            assert (await sh(kid, "cat /root/who")).strip() == "parent"
            await sh(kid, f"echo kid{i} > /root/who")
            seeds.add((await sh(kid, "head -c 16 /dev/urandom | od -An -tx1")).strip())
        assert len(seeds) == 2
        assert (await sh(parent, "cat /root/who")).strip() == "parent"
        for i, kid in enumerate(kids):
            assert (await sh(kid, "cat /root/who")).strip() == f"kid{i}"
            # The restored clock is the host's, not the parent's at the checkpoint.
            guest_now = int((await sh(kid, "date +%s")).strip())
            host = int((await sh(parent, "date +%s")).strip())
            assert abs(guest_now - host) < 30
    finally:
        for inst in (parent, *kids):
            await runtime.destroy(inst)


async def test_a_killed_qemu_is_seen_dead(runtime: QemuRuntime, specs: Specs) -> None:
    inst = await runtime.create(specs("qm-die"))
    try:
        await wait_http(inst, limit=BOOT_LIMIT)
        m = Machine.of(inst)
        os.kill(m.pid, signal.SIGKILL)
        for _ in range(100):
            if not await runtime.alive(inst):
                break
            await asyncio.sleep(0.05)
        assert not await runtime.alive(inst)
    finally:
        await runtime.destroy(inst)
