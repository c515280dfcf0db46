"""`QemuRuntime`: the `Runtime` on QEMU `microvm` guests (the package docstring says what
each sandbox is made of). This module holds the lifecycle: launch (boot or restore), stop,
destroy, pause, checkpoint, and the bookkeeping of which VMs this process holds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shlex
import shutil
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from aenv.background import Background
from aenv.config import Settings
from aenv.domain import EgressPolicy
from aenv.errors import RuntimeFailure
from aenv.runtime import _proc
from aenv.runtime.base import Instance, Runtime, SandboxSpec, Stats
from aenv.runtime.net.egress_ca import EgressCA
from aenv.runtime.net.network import Network, Slot, SlotAddressing, SlotPool
from aenv.runtime.net.slot_egress import SlotEgress
from aenv.runtime.qemu import disks, guest, image, provision, qmp, vmproc
from aenv.runtime.qemu.machine import (
    Control,
    Machine,
    argv,
    make_pipes,
    new_machine_id,
)
from aenv.runtime.qemu.recovery import recover
from aenv.runtime.rootfs import RootfsMounts

log = logging.getLogger("aenv.runtime")


class QemuRuntime(SlotEgress, Runtime):
    name = "qemu"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.home = settings.home / "qemu"
        self.vms_dir = self.home / "vms"
        self.addressing = SlotAddressing.from_settings(settings)
        self.network = Network(self.addressing)
        self.egress_ca = EgressCA(
            settings.egress_ca_dir, settings.egress_ca_bundle, settings.cluster_secrets_key()
        )
        self.pool = SlotPool(self.network, settings.net_pool_size)
        self.rootfs = RootfsMounts(settings.home / "mnt")
        self.images = disks.Images(self.home / "images", self.rootfs)
        self.ram_dir = Path("/dev/shm") / f"aenv-{settings.net_prefix}"
        self.control = Control()
        self.meter = vmproc.Meter()
        self.boot: guest.GuestBoot | None = None
        self.accel = "tcg"
        self._live: dict[str, Machine] = {}
        self._busy: set[str] = set()
        self._destroying: set[str] = set()
        self._tasks = Background(
            on_failure=lambda e: log.warning("background runtime task failed: %s", e)
        )
        self._started = False

    # Lifecycle of the backend ------------------------------------------------------------

    async def start(self, keep: set[str]) -> dict[str, Instance]:
        s = self.settings
        for d in (self.vms_dir, self.ram_dir):
            await asyncio.to_thread(d.mkdir, parents=True, exist_ok=True)
        self.boot = await guest.prepare(s.qemu_guest_dir, self.home / "boot")
        self.accel = await guest.choose_accel(s.qemu, self.boot, s.qemu_accel, self.home)
        await self.rootfs.prepare()
        await self.images.prepare()
        await asyncio.to_thread(self.egress_ca.load)
        self.network.proxies.ca = self.egress_ca
        await self.network.setup_host()
        self._live = await recover(self.vms_dir, self.ram_dir, self.network, s.net_prefix, keep)
        self.pool.start(reserved={m.slot for m in self._live.values()})
        self._started = True
        log.info("qemu runtime: %s, guest kernel %s", self.accel, self.boot.release)
        return {vid: m.handle() for vid, m in self._live.items()}

    async def close(self) -> None:
        self._started = False
        await self.pool.close()
        await self._tasks.join()
        await self.network.close()
        # VMs left running keep their RAM files here for the next start; none left: no trace.
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self.ram_dir.rmdir)

    async def purge(self) -> None:
        """Removes every VM, slot, image and host rule of this home/prefix (tests, uninstall)."""
        await self.close()
        prefix = self.settings.net_prefix
        self._live = await recover(self.vms_dir, self.ram_dir, self.network, prefix, set())
        await self.network.cleanup(set())
        await self.network.remove_host()
        await self.rootfs.remove()
        await asyncio.to_thread(shutil.rmtree, self.ram_dir, True)

    def ready_within(self) -> float:
        # A TCG guest boots its kernel and envd's Python in seconds, more when several boot
        # at once on a busy host (the node's pool fills while requests come in).
        return 20.0 if self.accel == "kvm" else 120.0

    def describe(self) -> dict[str, str]:
        return {"backend": self.name, "accelerator": self.accel}

    # Handles -----------------------------------------------------------------------------

    def _parse(self, inst: Instance) -> Machine:
        try:
            return Machine.of(inst)
        except (ValueError, KeyError, TypeError) as e:
            raise RuntimeFailure(f"{inst.id!r} is not an instance of the qemu runtime") from e

    def _view(self, inst: Instance) -> Machine:
        return self._live.get(inst.id) or self._parse(inst)

    def _running(self, inst: Instance) -> Machine:
        m = self._live.get(inst.id)
        if m is None or inst.id in self._destroying:
            raise RuntimeFailure(f"{inst.id} is not a sandbox of this runtime")
        if m.stopped or m.checkpointed:
            raise RuntimeFailure(f"{inst.id} is stopped")
        return m

    def is_stopped(self, inst: Instance) -> bool:
        return self._view(inst).stopped

    def image_complete(self, image_dir: Path) -> bool:
        return image.complete(image_dir)

    # Sandboxes ---------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec, *, reuse: Instance | None = None) -> Instance:
        return await self._launch(spec, None, reuse)

    async def restore(
        self, spec: SandboxSpec, image_dir: Path, *, reuse: Instance | None = None
    ) -> Instance:
        return await self._launch(spec, image_dir, reuse)

    async def _launch(
        self, spec: SandboxSpec, image_dir: Path | None, reuse: Instance | None
    ) -> Instance:
        if not self._started or self.boot is None:
            raise RuntimeFailure("the qemu runtime is not started")
        vm_id = new_machine_id(spec.sandbox_id)
        record: image.ImageRecord | None = None
        if image_dir is not None:
            record = await asyncio.to_thread(image.read, image_dir, self.accel)
        if spec.upper is not None and not await asyncio.to_thread(spec.upper.is_dir):
            raise RuntimeFailure(f"upper dir {spec.upper} does not exist")
        for mnt in spec.mounts:
            if not mnt.readonly:
                raise RuntimeFailure(
                    f"the qemu backend mounts read-only directories only ({mnt.destination})"
                )
        if spec.egress is not None:
            spec.egress.normalized()
        held = self._claim_stopped(reuse, spec) if reuse is not None else None
        slot: Slot | None = None
        m: Machine | None = None
        try:
            slot = self.addressing.slot(held.slot) if held else await self.pool.acquire()
            m = Machine(
                sandbox_id=spec.sandbox_id,
                id=vm_id,
                address=slot.router_ip,
                slot=slot.index,
                dir=self.vms_dir / vm_id,
                base=Path(),
                disk=self.vms_dir / vm_id / "disk.img",
                ram=self.ram_dir / f"{vm_id}.ram",
                cpu_count=max(1, spec.cpu_count),
                memory_mb=max(64, spec.memory_mb),
                accel=self.accel,
                cgroup=f"/{self.settings.net_prefix}/{vm_id}",
                upper=spec.upper,
            )
            await asyncio.to_thread(m.dir.mkdir, parents=True)
            net = self._ready_slot(slot, spec.egress or EgressPolicy())
            if image_dir is not None and record is not None:
                files = provision.files_from_image(m, image_dir, record)
            else:
                files = provision.files_for(self.images, m, spec)
            await _both(net, files)
            await self._start_vm(m, image_dir, record)
        except BaseException:
            if m is not None:
                with contextlib.suppress(Exception):
                    await self._remove_vm(m)
            if held is None and slot is not None:
                with contextlib.suppress(Exception):
                    await self.pool.release(slot)
            if held is not None:  # still the stopped sandbox it was, holding its slot
                self._live[held.id] = held
            raise
        finally:
            if held is not None:
                self._busy.discard(held.id)
        if held is not None:
            self._live.pop(held.id, None)
            await asyncio.to_thread(shutil.rmtree, held.dir, True)
        self._live[m.id] = m
        return m.handle()

    def _claim_stopped(self, reuse: Instance, spec: SandboxSpec) -> Machine:
        held = self._live.get(reuse.id)
        if held is None or not held.stopped:
            raise RuntimeFailure(f"{reuse.id} is not a stopped sandbox of this runtime")
        if held.sandbox_id != spec.sandbox_id:
            raise RuntimeFailure(
                f"{reuse.id} belongs to sandbox {held.sandbox_id}, not {spec.sandbox_id}"
            )
        if reuse.id in self._busy or reuse.id in self._destroying:
            raise RuntimeFailure(f"{reuse.id} is busy")
        self._busy.add(reuse.id)
        # Out of the table while its slot goes to the new VM: a destroy of it meanwhile
        # must not release that slot.
        self._live.pop(reuse.id, None)
        return held

    async def _ready_slot(self, slot: Slot, policy: EgressPolicy) -> None:
        await provision.bridge(slot.inner_ns)
        await self.network.apply_egress(slot.index, policy)

    async def _start_vm(
        self, m: Machine, image_dir: Path | None, record: image.ImageRecord | None
    ) -> None:
        assert self.boot is not None
        t0 = time.perf_counter()
        await asyncio.to_thread(make_pipes, m)
        slot = self.addressing.slot(m.slot)
        cmd = argv(
            self.settings.qemu,
            m,
            self.boot.kernel,
            self.boot.initrd,
            self.boot.cmdline(),
            incoming=image_dir is not None,
        )
        await asyncio.to_thread(m.save)  # before QEMU runs: a crash leaves it to clean up
        await _proc.run_detached(
            ["ip", "netns", "exec", slot.inner_ns, *cmd], output=m.dir / "qemu.log", time_limit=120
        )
        m.pid = await asyncio.to_thread(vmproc.read_pid, m)
        m.started_at = time.time()
        # Its pid on disk at once: a crash during a restore's migration must not leave a
        # QEMU that recovery cannot find.
        await asyncio.to_thread(m.save)
        await asyncio.to_thread(vmproc.confine, m)
        if image_dir is not None and record is not None:
            m.restored_from = str(image_dir)
            await qmp.call(
                m.qmp,
                "migrate-set-capabilities",
                capabilities=[{"capability": "x-ignore-shared", "state": record.memory_file}],
            )
            await qmp.call(
                m.qmp,
                "migrate-incoming",
                uri=f"exec:cat {shlex.quote(str(image_dir / image.STATE))}",
            )
            await qmp.wait_migration(m.qmp)
            if await qmp.status(m.qmp) != "running":
                await qmp.call(m.qmp, "cont")
            # A child's clock is the parent's at the checkpoint, its entropy the parent's.
            await self.control.ask(m, f"resume {int(time.time())} {secrets.token_hex(32)}")
        await asyncio.to_thread(m.save)
        log.info(
            "%s %s in slot %d at %s: %.0f ms",
            "restored" if image_dir else "booted",
            m.id,
            m.slot,
            m.address,
            (time.perf_counter() - t0) * 1000,
        )

    async def _end_vm(self, m: Machine) -> None:
        """Kills the VM's QEMU and waits until it is gone."""
        pid = await asyncio.to_thread(vmproc.kill, m)
        if pid and not await _proc.wait_exited([pid], 10.0):
            log.warning("qemu %d of %s did not exit", pid, m.id)
        vmproc.reap(m.pid)

    async def _remove_vm(self, m: Machine) -> None:
        """Everything of a VM but its slot: QEMU, its dir, its RAM file, its cgroup."""
        await self._end_vm(m)
        self.meter.forget(m.id)
        self.control.forget(m.id)
        await asyncio.to_thread(vmproc.keep_console, m, self.home / "consoles")
        await asyncio.to_thread(shutil.rmtree, m.dir, True)
        if m.ram_shared:
            await asyncio.to_thread(m.ram.unlink, missing_ok=True)
        await asyncio.to_thread(vmproc.remove_cgroup, m.cgroup)

    async def stop(self, inst: Instance) -> None:
        m = self._live.get(inst.id)
        if m is not None and m.stopped:
            m.write_to(inst)
            return
        if m is None or inst.id in self._destroying:
            raise RuntimeFailure(f"{inst.id} is not a sandbox of this runtime")
        if inst.id in self._busy:
            raise RuntimeFailure(f"{inst.id} is busy")
        self._busy.add(inst.id)
        try:
            if not m.checkpointed and vmproc.running(m):
                with contextlib.suppress(RuntimeFailure, OSError):
                    # A paused guest synced as it was paused, and cannot answer now.
                    if await qmp.status(m.qmp) == "running":
                        await self._sync_guest(m)
            await self._end_vm(m)
            if m.upper is not None:
                try:
                    await disks.copy_upper_out(m.disk, m.upper)
                except RuntimeFailure as e:  # its own disk, broken from inside: files lost
                    log.warning("the files of %s could not be read from its disk: %s", m.id, e)
            for p in (m.disk, m.config_disk):
                await asyncio.to_thread(p.unlink, missing_ok=True)
            if m.ram_shared:
                await asyncio.to_thread(m.ram.unlink, missing_ok=True)
            await asyncio.to_thread(vmproc.remove_cgroup, m.cgroup)
            m.stopped, m.checkpointed, m.pid = True, False, 0
            await asyncio.to_thread(m.save)
            self.meter.forget(m.id)
        finally:
            self._busy.discard(inst.id)
        m.write_to(inst)

    async def destroy(self, inst: Instance) -> None:
        if inst.id in self._destroying:
            return
        m = self._live.pop(inst.id, None)
        owned = m is not None
        if m is None:
            try:
                m = self._parse(inst)
            except RuntimeFailure:
                return
        self._destroying.add(inst.id)
        await asyncio.to_thread(vmproc.kill, m)
        task = self._tasks.spawn(self._finish(m, owned))
        task.add_done_callback(lambda _t: self._destroying.discard(inst.id))

    async def _finish(self, m: Machine, owned: bool) -> None:
        await self._remove_vm(m)
        if owned:
            await self.pool.release(m.slot)

    async def _sync_guest(self, m: Machine) -> None:
        """The guest's page cache written to its disk (before the host reads the disk)."""
        await self.control.ask(m, "sync", timeout=60.0)

    async def sync_files(self, inst: Instance) -> None:
        m = self._live.get(inst.id)
        if m is None or inst.id in self._destroying:
            raise RuntimeFailure(f"{inst.id} is not a sandbox of this runtime")
        if m.upper is None or m.stopped:  # a stop copied them out already
            return
        if m.checkpointed:  # QEMU is gone, its disk is not: as the guest synced it
            await disks.copy_upper_out(m.disk, m.upper)
            return
        running = await qmp.status(m.qmp) == "running"
        if running:  # the files of one instant: its vCPUs stopped while they are copied
            try:
                await self._sync_guest(m)
            except RuntimeFailure as e:  # a wedged guest: what reached its disk
                log.warning("the guest of %s did not sync: %s", m.id, e)
            await qmp.call(m.qmp, "stop")
        try:
            await disks.copy_upper_out(m.disk, m.upper)
        finally:
            if running:
                await qmp.call(m.qmp, "cont")

    async def freeze(self, inst: Instance) -> None:
        m = self._running(inst)
        if await qmp.status(m.qmp) == "running":
            await self._sync_guest(m)
            await qmp.call(m.qmp, "stop")
        if m.upper is not None:  # the host's upper shows the frozen files
            await disks.copy_upper_out(m.disk, m.upper)

    async def thaw(self, inst: Instance) -> None:
        m = self._running(inst)
        if await qmp.status(m.qmp) != "running":
            await qmp.call(m.qmp, "cont")

    async def is_frozen(self, inst: Instance) -> bool:
        m = self._view(inst)
        if m.stopped or m.checkpointed or not vmproc.running(m):
            return False
        with contextlib.suppress(RuntimeFailure):
            return await qmp.status(m.qmp) in ("paused", "postmigrate")
        return False

    async def checkpoint(
        self, inst: Instance, image_dir: Path, *, leave_running: bool, hold: bool = False
    ) -> None:
        m = self._running(inst)
        t0 = time.perf_counter()
        await asyncio.to_thread(image_dir.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread((image_dir / image.RECORD).unlink, missing_ok=True)
        if await qmp.status(m.qmp) == "running":
            await self._sync_guest(m)
            await qmp.call(m.qmp, "stop")
        # As on gVisor, a sandbox checkpointed leaving it running runs afterwards (a frozen
        # one too), also when the checkpoint failed; a held one stays stopped until `thaw`.
        try:
            await self._save(m, image_dir)
            if hold and m.upper is not None:
                await disks.copy_upper_out(m.disk, m.upper)
        except BaseException:
            if leave_running and not hold:
                with contextlib.suppress(RuntimeFailure):
                    await qmp.call(m.qmp, "cont")
            raise
        if leave_running and not hold:
            await qmp.call(m.qmp, "cont")
        elif not leave_running:
            await self._end_vm(m)
            m.checkpointed = True
            await asyncio.to_thread(m.save)
            m.write_to(inst)
        log.info(
            "checkpointed %s to %s in %.0f ms", m.id, image_dir, (time.perf_counter() - t0) * 1000
        )

    async def _save(self, m: Machine, image_dir: Path) -> None:
        """The stopped VM's image: RAM that is a file of the VM's own is copied as a file (a
        reflink where the file system can), RAM mapped from an image goes into the stream."""
        await qmp.call(
            m.qmp,
            "migrate-set-capabilities",
            capabilities=[{"capability": "x-ignore-shared", "state": m.ram_shared}],
        )
        await qmp.call(
            m.qmp, "migrate", uri=f"exec:cat > {shlex.quote(str(image_dir / image.STATE))}"
        )
        await qmp.wait_migration(m.qmp)
        copies = [
            asyncio.to_thread(disks.pack, m.disk, image_dir / image.DISK),
            disks.copy_file(m.config_disk, image_dir / image.CONFIG),
        ]
        if m.ram_shared:
            copies.append(disks.copy_file(m.ram, image_dir / image.MEMORY))
        await asyncio.gather(*copies)
        written = image.ImageRecord.of(m).to_json()
        await asyncio.to_thread((image_dir / image.RECORD).write_text, written)

    async def alive(self, inst: Instance) -> bool:
        mine = self._parse(inst)
        held = self._live.get(inst.id, mine)
        if mine.stopped or held.stopped or held.checkpointed or inst.id in self._destroying:
            return False
        return await asyncio.to_thread(vmproc.running, held)

    async def exit_cause(self, inst: Instance) -> str | None:
        return await asyncio.to_thread(vmproc.exit_cause, self._view(inst))

    async def stats(self, inst: Instance) -> Stats:
        return await asyncio.to_thread(self.meter.stats, self._view(inst))


async def _both(a: Coroutine[Any, Any, None], b: Coroutine[Any, Any, None]) -> None:
    """Both, concurrently; when one fails the other is cancelled and waited for, so the
    cleanup that follows never races a half of the setup still at work."""
    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(a)
            group.create_task(b)
    except BaseExceptionGroup as failed:  # the first failure, as `gather` would raise it
        raise failed.exceptions[0] from None
