"""`GVisorRuntime`: the `Runtime` on runsc. The package docstring describes what it makes on
the host; this module holds the lifecycle of containers (launch, stop, destroy, freeze,
checkpoint) and the bookkeeping of which ones this process holds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aenv.background import Background
from aenv.config import Settings
from aenv.domain import ENVD_PORT, EgressPolicy
from aenv.errors import RuntimeFailure
from aenv.runtime import checkpoints, naps, priority, rootfs
from aenv.runtime.base import Instance, Runtime, SandboxSpec, Stats
from aenv.runtime.freezer import CGROUP_ROOT, Freezer
from aenv.runtime.gvisor import bundles, control, netquiet, oci, runsc
from aenv.runtime.gvisor.container import OVERLAY_MEMORY, Container, new_container_id
from aenv.runtime.gvisor.guarding import ContainerGuards
from aenv.runtime.gvisor.processes import Processes
from aenv.runtime.gvisor.reaping import Reaper
from aenv.runtime.gvisor.reconcile import Reconciler
from aenv.runtime.gvisor.runsc import Runsc, gather_quiet
from aenv.runtime.gvisor.stats import StatsReader, exit_cause
from aenv.runtime.net.egress_ca import EgressCA
from aenv.runtime.net.network import Network, Slot, SlotAddressing, SlotPool
from aenv.runtime.net.slot_egress import SlotEgress
from aenv.runtime.rootfs import RootfsMounts

log = logging.getLogger("aenv.runtime")


class GVisorRuntime(SlotEgress, Runtime):
    name = "gvisor"

    def __init__(self, settings: Settings, *, debug: bool | None = None) -> None:
        self.settings = settings
        if debug is None:  # full runsc debug logs per sandbox (bundle/debug/)
            debug = bool(getattr(settings, "runsc_debug", False))
        self.addressing = SlotAddressing.from_settings(settings)
        self.runsc = Runsc(
            settings.runsc,
            settings.runsc_root,
            platform=settings.runsc_platform,
            overlay=OVERLAY_MEMORY,
            debug=debug,
        )
        self.network = Network(self.addressing)
        # Signs the certificates of hosts whose HTTPS the egress proxy opens (header rules).
        # A cluster's nodes share its key: one CA for all (egress_ca's docstring).
        self.egress_ca = EgressCA(
            settings.egress_ca_dir, settings.egress_ca_bundle, settings.cluster_secrets_key()
        )
        self.pool = SlotPool(self.network, settings.net_pool_size)
        self.rootfs = RootfsMounts(settings.home / "mnt")
        self.freezer = Freezer(CGROUP_ROOT)
        self.procs = Processes(self.runsc, self.freezer, settings.net_prefix)
        self.reconciler = Reconciler(
            settings, self.procs, self.network, self.addressing, self.rootfs
        )
        self.meter = StatsReader(self.runsc)
        # Containers whose slot (and rootfs, unless stopped) this object holds.
        self._live: dict[str, Container] = {}
        self._destroying: set[str] = set()
        # Containers being stopped, or stopped ones being started again.
        self._busy: set[str] = set()
        self.reaper = Reaper()
        self._tasks = Background(
            on_failure=lambda e: log.warning("background runtime task failed: %s", e)
        )
        self._started = False
        # Armed on `on_memory_pressure`; finds containers at each signal (`start` swaps _live).
        self.guards = ContainerGuards(lambda cid: self._live.get(cid))

    # Lifecycle of the backend ------------------------------------------------------------

    async def start(self, keep: set[str]) -> dict[str, Instance]:
        s = self.settings
        for d in (s.runsc_root, s.sandboxes_dir):
            await asyncio.to_thread(d.mkdir, parents=True, exist_ok=True)
        # Before the first container starts: its orphaned processes must come to us.
        self.reaper.start()
        await self.runsc.probe()
        await asyncio.to_thread(priority.favour_node, s.net_prefix)
        await self.rootfs.prepare()
        await asyncio.to_thread(self.egress_ca.load)
        self.network.proxies.ca = self.egress_ca
        await self.network.setup_host()
        recovered = await self.reconciler.recover(keep, self._tasks.spawn)
        for c in recovered.values():
            c.cgroup = c.cgroup or self.procs.cgroup(c.id)
            if not c.stopped:
                await self.guards.arm(c)
        self._live = dict(recovered)
        self.pool.start(reserved={c.slot for c in recovered.values()})
        self._started = True
        return {cid: c.handle() for cid, c in recovered.items()}

    async def close(self) -> None:
        self._started = False
        self.guards.close()
        await self.pool.close()
        await self.wait_idle()
        await self.network.close()
        await self.reaper.close()

    async def wait_idle(self) -> None:
        """Awaits the background work started so far (the rest of destroys)."""
        await self._tasks.join()

    async def purge(self) -> None:
        """Removes every trace of this prefix/home from the host: containers, slots, mounts,
        bundles, work dirs, cgroups and the host rules. For tests and uninstall; running
        sandboxes die. Upper dirs (the orchestrator's) are left alone."""
        await self.close()
        self._live.clear()
        await self.reconciler.purge()

    def describe(self) -> dict[str, str]:
        return {"backend": self.name, "accelerator": self.settings.runsc_platform}

    # Handles -----------------------------------------------------------------------------

    def _parse(self, inst: Instance) -> Container:
        """The caller's view of a container, from its handle."""
        try:
            c = Container.of(inst)
        except ValueError as e:
            raise RuntimeFailure(f"{inst.id!r} is not an instance of the gvisor runtime") from e
        c.cgroup = c.cgroup or self.procs.cgroup(c.id)
        return c

    def _view(self, inst: Instance) -> Container:
        """This runtime's own record of the container if it holds one, else the handle's."""
        return self._live.get(inst.id) or self._parse(inst)

    def is_stopped(self, inst: Instance) -> bool:
        return self._parse(inst).stopped

    def image_complete(self, image_dir: Path) -> bool:
        return runsc.image_complete(image_dir)

    # Sandboxes ---------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec, *, reuse: Instance | None = None) -> Instance:
        return await self._launch(spec, image_dir=None, reuse=reuse)

    async def restore(
        self, spec: SandboxSpec, image_dir: Path, *, reuse: Instance | None = None
    ) -> Instance:
        return await self._launch(spec, image_dir=image_dir, reuse=reuse)

    async def _launch(
        self, spec: SandboxSpec, image_dir: Path | None, reuse: Instance | None
    ) -> Instance:
        if not self._started:
            raise RuntimeFailure("the gvisor runtime is not started")
        if not bundles.ID_RE.fullmatch(spec.sandbox_id):
            raise RuntimeFailure(f"invalid sandbox id {spec.sandbox_id!r}")
        if image_dir is not None:
            await asyncio.to_thread(checkpoints.refuse_foreign, image_dir, self.name)
        if image_dir is not None and not await asyncio.to_thread(self.image_complete, image_dir):
            raise RuntimeFailure(f"no complete checkpoint image at {image_dir}")
        if spec.upper is not None and not await asyncio.to_thread(spec.upper.is_dir):
            raise RuntimeFailure(f"upper dir {spec.upper} does not exist")
        if spec.egress is not None:
            spec.egress.normalized()  # ValueError for a bad entry, before anything is taken
        t0 = time.perf_counter()
        held = self._claim_stopped(reuse, spec) if reuse is not None else None
        # Network work, done while the rootfs and bundle are prepared.
        net: asyncio.Task[None] | None = None
        try:
            if held is not None:
                cid = held.id
                if await asyncio.to_thread(self.runsc.sandbox_state_file, cid) is not None:
                    # Not deleted yet (see stop) or its delete failed: the slot is ours, the
                    # id is not free. The old container is deleted once this one runs.
                    cid = new_container_id(spec.sandbox_id, self.settings.runsc_root)
                slot = self.addressing.slot(held.slot)
                # Always rewritten: the slot keeps whatever rules it had before the stop.
                net = asyncio.create_task(
                    self._ready_slot(slot.index, spec.egress or EgressPolicy(), rearm=True)
                )
            else:
                cid = new_container_id(spec.sandbox_id, self.settings.runsc_root)
                slot = await self.pool.acquire()
                if spec.egress is not None and not spec.egress.is_open:
                    net = asyncio.create_task(
                        self._ready_slot(slot.index, spec.egress, rearm=False)
                    )
            if net is not None:
                net.add_done_callback(_retrieve)
        except BaseException:
            if held is not None:
                self._busy.discard(held.id)
            raise
        c = Container.for_spec(spec, cid, slot, self.settings.sandboxes_dir, self.procs.cgroup(cid))
        if held is not None:
            self._live.pop(held.id, None)
        self._live[cid] = c
        try:
            t1 = await self._boot(
                spec, c, slot, image_dir, fresh_bundle=held is None, before_runsc=net
            )
        except BaseException:
            if net is not None and not net.done():
                net.cancel()
            self._live.pop(cid, None)
            if held is None:
                task = self._tasks.spawn(self._finish(c, owned=True))
            else:
                task = self._tasks.spawn(self._unlaunch(c, held))
            with contextlib.suppress(Exception):
                await asyncio.shield(task)
            raise
        finally:
            if held is not None:
                self._busy.discard(held.id)
        if held is not None and held.id != cid:
            self._tasks.spawn(self._discard_container(held))
        await self.guards.arm(c)
        log.info(
            "%s %s in slot %d at %s%s: %.0f ms (runsc %.0f ms)",
            "restored" if image_dir else "created",
            cid,
            slot.index,
            slot.router_ip,
            " (reused)" if held is not None else "",
            (time.perf_counter() - t0) * 1000,
            (time.perf_counter() - t1) * 1000,
        )
        return c.handle()

    async def _ready_slot(self, n: int, policy: EgressPolicy, *, rearm: bool) -> None:
        """A slot's network before runsc starts in it: its address put back (a reused slot,
        see `Network.rearm`) and the sandbox's egress rules."""
        if rearm:
            await self.network.rearm(n)
        await self.network.apply_egress(n, policy)

    def _claim_stopped(self, reuse: Instance, spec: SandboxSpec) -> Container:
        """The runtime's own record of the stopped instance `reuse`, marked busy."""
        cid = reuse.id
        held = self._live.get(cid)
        if held is None or not held.stopped:
            raise RuntimeFailure(f"container {cid} is not a stopped sandbox of this runtime")
        if held.sandbox_id != spec.sandbox_id:
            raise RuntimeFailure(
                f"container {cid} belongs to sandbox {held.sandbox_id}, not {spec.sandbox_id}"
            )
        if cid in self._busy or cid in self._destroying:
            raise RuntimeFailure(f"container {cid} is busy")
        self._busy.add(cid)
        return held

    async def _boot(
        self,
        spec: SandboxSpec,
        c: Container,
        slot: Slot,
        image_dir: Path | None,
        *,
        fresh_bundle: bool,
        before_runsc: asyncio.Task[None] | None = None,
    ) -> float:
        """Bundle, rootfs and `runsc run/restore`; returns when runsc started (perf counter).
        `before_runsc` (network work started by the caller) is awaited before runsc runs."""
        cid, bundle = c.id, c.bundle_dir
        # instance.json first: a crash from here on leaves what reconcile needs to clean up.
        await asyncio.to_thread(bundles.make, c, fresh_bundle)
        if spec.upper is not None:
            assert c.rootfs_mount is not None and c.workdir is not None
            await rootfs.mount_writable(spec.layers, spec.upper, c.workdir, c.rootfs_mount)
            root = c.rootfs_mount
            tmp_on_rootfs = await asyncio.to_thread(rootfs.ensure_tmp, root)
        else:
            root, c.rootfs_key = await self.rootfs.acquire(spec.layers, cid)
            tmp_on_rootfs = False
        cfg = oci.config(
            spec,
            rootfs=root,
            netns_path=slot.netns_path,
            cgroups_path=c.cgroup,
            tmp_on_rootfs=tmp_on_rootfs,
        )
        await asyncio.to_thread(bundles.write_config, bundle, cfg)
        await asyncio.to_thread(c.save)
        if before_runsc is not None:
            await before_runsc
        t1 = time.perf_counter()
        if image_dir is None:
            args = ["run", "--detach", f"--bundle={bundle}", cid]
        else:
            c.restored_from = str(image_dir)
            args = ["restore", "--detach", f"--bundle={bundle}", f"--image-path={image_dir}", cid]
        await self.runsc.detached(
            *args,
            output=bundle / "console.log",
            log_dir=bundle,
            time_limit=600,
            overlay=c.overlay,
        )
        c.pid, c.gofer_pid = self.runsc.read_pids(cid)
        c.started_at = time.time()
        await asyncio.to_thread(c.save)
        await asyncio.to_thread(self.meter.baseline, c)
        return t1

    async def _unlaunch(self, c: Container, held: Container) -> None:
        """A failed start of a stopped sandbox: removes what it made, keeps the slot and puts
        the stopped instance back, so the caller can retry or destroy it."""
        await self.procs.remove(c, kill=True)
        await self._release_rootfs(c)
        if c.bundle_dir != held.bundle_dir:
            await asyncio.to_thread(bundles.remove, c.bundle_dir)
        await asyncio.to_thread(held.save)
        self._live[held.id] = held

    async def _discard_container(self, old: Container) -> None:
        """The leftover container and bundle of a stopped sandbox that was started again
        under a new id (its slot now belongs to the new container)."""
        await self.procs.remove(old, kill=True)
        await asyncio.to_thread(bundles.remove, old.bundle_dir)

    async def stop(self, inst: Instance) -> None:
        cid = inst.id
        held = self._live.get(cid)
        if held is not None and held.stopped:
            held.write_to(inst)
            return
        if held is None or cid in self._destroying:
            raise RuntimeFailure(f"container {cid} is not a sandbox of this runtime")
        if cid in self._busy:
            raise RuntimeFailure(f"container {cid} is busy")
        self._busy.add(cid)
        self.guards.disarm(cid)
        t0 = time.perf_counter()
        try:
            # After a checkpoint the sandbox exits by itself; its `runsc delete` is left to
            # the next start (under a new id) or to destroy, off the snapshot's path.
            done = held.checkpointed
            await self.procs.remove(held, kill=not done, delete=not done)
            await self._release_rootfs(held)
            held.stopped, held.stopped_at = True, time.time()
            held.pid = held.gofer_pid = 0
            held.rootfs_key, held.checkpointed = None, False
            await asyncio.to_thread(held.save)
            self.meter.forget(cid)
        finally:
            self._busy.discard(cid)
        held.write_to(inst)
        log.info("stopped %s in %.0f ms", cid, (time.perf_counter() - t0) * 1000)

    async def _release_rootfs(self, c: Container) -> None:
        """Unmounts a writable overlay (and removes its work dir, never `upper`), or drops the
        reference to a shared read-only stack."""
        if c.rootfs_mount is not None and not c.stopped:
            if await rootfs.unmount(c.rootfs_mount):
                if c.workdir is not None:
                    await asyncio.to_thread(rootfs.remove_work_dir, c.workdir)
            else:
                log.warning("could not unmount %s", c.rootfs_mount)
        await self.rootfs.release(c.rootfs_key, c.id)

    async def destroy(self, inst: Instance) -> None:
        cid = inst.id
        if cid in self._destroying:
            return
        held = self._live.pop(cid, None)
        owned = held is not None
        c = held if held is not None else self._parse(inst)
        self._destroying.add(cid)
        self.guards.disarm(cid)
        if not c.stopped:
            try:
                self.procs.kill_sandbox(c)
            except OSError as e:
                log.warning("killing sandbox %s: %s", cid, e)
        task = self._tasks.spawn(self._finish(c, owned=owned))
        task.add_done_callback(lambda _t: self._destroying.discard(cid))

    async def _finish(self, c: Container, *, owned: bool) -> None:
        """Everything of a container after its sandbox was killed (or failed to start, or was
        stopped)."""
        cid = c.id
        t0 = time.perf_counter()
        if not c.stopped:
            await self.procs.remove(c, kill=True)
        elif await asyncio.to_thread(self.runsc.sandbox_state_file, cid) is not None:
            await self.procs.remove(c, kill=True)  # stopped, delete left for later
        if owned:
            await gather_quiet(self.pool.release(c.slot), self._release_rootfs(c))
        elif c.rootfs_mount is not None and not c.stopped:
            # Not ours (a record from before a restart that start() did not recover): its
            # mount, if any, is ours to remove all the same.
            await self._release_rootfs(c)
        await asyncio.to_thread(bundles.remove, c.bundle_dir)
        self.meter.forget(cid)
        log.debug("finished %s in %.0f ms", cid, (time.perf_counter() - t0) * 1000)

    def _running(self, inst: Instance) -> Container:
        """The container behind a handle, which must not be stopped."""
        c = self._view(inst)
        if c.stopped:
            raise RuntimeFailure(f"container {inst.id} is stopped")
        return c

    async def freeze(self, inst: Instance) -> None:
        c = self._running(inst)
        if await asyncio.to_thread(self.freezer.available, c.cgroup):
            await asyncio.to_thread(self.freezer.freeze, c.cgroup)
        else:
            await self.runsc.pause(c.id)

    async def thaw(self, inst: Instance) -> None:
        c = self._running(inst)
        if control.is_held(c.bundle_dir):
            await asyncio.to_thread(control.let_go, c.bundle_dir)
        elif await asyncio.to_thread(self.freezer.is_frozen, c.cgroup):
            await asyncio.to_thread(self.freezer.thaw, c.cgroup)
        else:  # paused by runsc (no freezer on this host)
            await self.runsc.resume(c.id)

    async def checkpoint(
        self, inst: Instance, image_dir: Path, *, leave_running: bool, hold: bool = False
    ) -> None:
        c = self._running(inst)
        await asyncio.to_thread(image_dir.mkdir, parents=True, exist_ok=True)
        t0 = time.perf_counter()
        # A frozen sandbox is checkpointed as it stands: runsc stops its tasks first thing.
        await asyncio.to_thread(self.procs.unfreeze, c.id, c.cgroup)
        # Awake: a napping sentry's timers lag by up to a second, and the barrier below
        # must come back within one (without it the restored copy's network may wedge).
        await asyncio.to_thread(naps.set_slack, c.cgroup, 0)
        state = self.runsc.sandbox_state_file(c.id)
        # Before the hold (the sentry's own pause, kept by a leave-running checkpoint): the
        # drop ends with a round trip through the running sandbox.
        await netquiet.drop_connections(c.address, ENVD_PORT)
        if hold:
            await asyncio.to_thread(control.hold, state, c.bundle_dir)
        # What `runsc checkpoint` would send, without starting runsc (~20 ms).
        await asyncio.to_thread(
            control.checkpoint, state, image_dir, leave_running=leave_running, timeout=600.0
        )
        if not leave_running:
            # The sandbox exits, though `runsc state` may still say running for a while.
            self.guards.disarm(c.id)
            c.checkpointed = True
            c.write_to(inst)
        log.info(
            "checkpointed %s to %s in %.0f ms", c.id, image_dir, (time.perf_counter() - t0) * 1000
        )

    def on_memory_pressure(self, listener: Callable[[Instance], None]) -> None:
        self.guards.listen(listener)

    async def nap(self, inst: Instance, on: bool) -> None:
        c = self._view(inst)
        if c.stopped or c.checkpointed or inst.id in self._destroying:
            return
        await asyncio.to_thread(naps.set_slack, c.cgroup, naps.NAP_SLACK_NS if on else 0)

    async def is_frozen(self, inst: Instance) -> bool:
        c = self._view(inst)
        return not c.stopped and await self.procs.is_frozen(c)

    async def alive(self, inst: Instance) -> bool:
        mine = self._parse(inst)
        held = self._live.get(inst.id, mine)
        if mine.checkpointed or mine.stopped or held.stopped or inst.id in self._destroying:
            return False
        return await self.procs.is_running(mine)

    async def stats(self, inst: Instance) -> Stats:
        return await self.meter.stats(self._view(inst))

    async def exit_cause(self, inst: Instance) -> str | None:
        return await asyncio.to_thread(exit_cause, self._view(inst))


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Marks a task's exception as seen (whoever awaits it gets it; nobody else logs it)."""
    if not task.cancelled():
        task.exception()
