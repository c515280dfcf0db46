"""The gVisor (`runsc`) backend: the default, and the one that can checkpoint and fork.

Per container (a sandbox has one at a time; a fork child is a new one with a new id):

    $AENV_HOME/sandboxes/<sandbox_id>/<container_id>/
        config.json     OCI spec generated here (rootfs, mounts, netns of the slot, limits)
        instance.json   the `Instance` (what `start()` recovers after a restart)
        rootfs/         the host overlay mount point (sandboxes with an `upper` dir)
        console.log     stdio of `runsc run/restore` and of the sandbox's init process
        runsc.log       runsc's own log (errors); `debug/` with full logs when debug is on

* rootfs (`rootfs.py`), per sandbox by `spec.upper`:
  - `upper` set: a writable host overlay (layers + `upper` + a work dir
    `<upper's parent>/work-<container_id>`) mounted at `rootfs/`, runsc `--overlay2=none`:
    rootfs writes land in `upper` on the host, not in memory nor in checkpoints (the sentry's
    own tmpfs mounts such as `/tmp` still are in the checkpoint).
  - `upper` None: the layer itself or a shared read-only overlay of the stack, runsc
    `--overlay2=root:memory`: writes stay in the sentry's memory and travel in checkpoints.
* stop / re-stack: `checkpoint(leave_running=False)` then `stop()` removes the container and
  unmounts its overlay but keeps the network slot (the instance is "stopped"); the caller may
  seal `upper`, and `restore(..., reuse=inst)` starts the sandbox again in the same slot with
  the same container id (so the same address), on a new stack and a new upper.
* network: one slot (`network.py`) per container; the instance's address is the router address.
* limits: `linux.resources` + `linux.cgroupsPath=/<net_prefix>/<container_id>` (runsc creates
  the cgroups; on this host's cgroup v1 hierarchies, memory and cpu quota apply to the sandbox
  and gofer processes; exceeding the memory limit OOM-kills the whole sandbox, not the host).
* destroy: the awaited part only SIGKILLs the sandbox process (it stops serving at once);
  `runsc delete`, slot teardown, unmount and bundle removal finish in a tracked background task
  that `close()` awaits.
* processes: the runtime makes this process a child subreaper, so the runsc sandbox and gofer
  processes it starts are re-parented here and reaped as soon as they exit (`_proc.reap`):
  `runsc delete` of a stopped container then takes ~20 ms instead of waiting for init.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from aenv.config import Settings
from aenv.errors import RuntimeFailure
from aenv.runtime import _proc, oci, rootfs
from aenv.runtime.base import Instance, Runtime, SandboxSpec, Stats
from aenv.runtime.freezer import CGROUP_ROOT, Freezer
from aenv.runtime.network import NETNS_DIR, SYS_NET, Network, Slot, SlotAddressing, SlotPool
from aenv.runtime.rootfs import RootfsMounts
from aenv.runtime.runsc import RUNNING_STATES, Runsc, gather_quiet, is_missing

log = logging.getLogger("aenv.runtime")

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,100}")
_BUNDLE_MARKERS = ("instance.json", "config.json")
_MAX_SOCKET_PATH = 107  # runsc's control socket `<root>/runsc-<id>.sock` (sun_path)
OVERLAY_MEMORY = "root:memory"  # rootfs writes in the sentry's memory (no `upper`)
OVERLAY_NONE = "none"  # rootfs writes to the host overlay's upper dir


class GVisorRuntime(Runtime):
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
        self.pool = SlotPool(self.network, settings.net_pool_size)
        self.rootfs = RootfsMounts(settings.home / "mnt")
        self.freezer = Freezer(CGROUP_ROOT)
        # Containers whose slot (and rootfs, unless stopped) this object holds.
        self._live: dict[str, Instance] = {}
        self._destroying: set[str] = set()
        # Containers being stopped, or stopped ones being started again.
        self._busy: set[str] = set()
        self._subreaper = False
        self._reaper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cpu_samples: dict[str, tuple[float, int]] = {}
        self._started = False

    # Lifecycle of the backend ------------------------------------------------------------

    async def start(self, keep: set[str]) -> dict[str, Instance]:
        s = self.settings
        for d in (s.runsc_root, s.sandboxes_dir):
            await asyncio.to_thread(d.mkdir, parents=True, exist_ok=True)
        if not self._subreaper:
            self._subreaper = _proc.become_subreaper()
            if not self._subreaper:
                log.warning("cannot become a child subreaper: deleting containers is slower")
        await self.runsc.probe()
        await self.rootfs.prepare()
        await self.network.setup_host()

        recovered: dict[str, Instance] = {}
        stale: list[str] = []
        # Read from runsc's state files: `runsc list` would hang on a frozen (paused) sandbox.
        for c in await self.runsc.list_states():
            cid = str(c.get("id"))
            inst = None
            if cid in keep and c.get("status") in RUNNING_STATES:
                inst = await asyncio.to_thread(_load_instance, Path(str(c.get("bundle"))))
            if (
                inst is not None
                and inst.container_id == cid
                and not self.is_stopped(inst)
                and await self.alive(inst)
                and await asyncio.to_thread(self._slot_exists, inst.slot)
            ):
                recovered[cid] = inst
            else:
                stale.append(cid)
        # Stale containers are killed now; their `runsc delete` can take a minute after a
        # crash (their processes now belong to init, which reaps slowly), so it finishes in
        # the background instead of holding up the server's start.
        await self._kill_containers(stale)
        self._spawn(self._delete_containers(stale))
        # Stopped sandboxes (no container, slot kept) the catalog still knows; a container
        # left over from a failed stop was deleted just above.
        for cid in sorted(keep - set(recovered)):
            inst = await asyncio.to_thread(self._find_stopped, cid)
            if inst is not None and await asyncio.to_thread(self._slot_exists, inst.slot):
                recovered[cid] = inst

        slots = {inst.slot for inst in recovered.values()}
        removed_slots = await self.network.cleanup(keep=slots)
        # Writable overlays of recovered running sandboxes stay mounted (a mount outlives
        # the server that made it): re-adopted as they are; every other one under the
        # sandboxes dir is stale.
        mounted = {
            Path(str(inst.extra["rootfs_mount"]))
            for inst in recovered.values()
            if inst.extra.get("rootfs_mount") and not self.is_stopped(inst)
        }
        unmounted = await self._unmount_stale(keep=mounted)
        for mnt in mounted:
            if not await asyncio.to_thread(rootfs.is_mount_point, mnt):
                log.warning("rootfs overlay %s of a recovered sandbox is not mounted", mnt)
        keys: dict[str, set[str]] = {}
        for cid, inst in recovered.items():
            key = inst.extra.get("rootfs_key")
            if key and not self.is_stopped(inst):
                keys.setdefault(str(key), set()).add(cid)
        unmounted += await self.rootfs.cleanup(keep=set(keys))
        for key, owners in keys.items():
            for cid in owners:
                self.rootfs.adopt(key, cid)
        bundles = await asyncio.to_thread(self._cleanup_bundles, set(recovered))
        await asyncio.to_thread(self._cleanup_cgroups, set(recovered), False)

        self._live = dict(recovered)
        self.pool.start(reserved=slots)
        if self._subreaper and self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_loop(), name="aenv-reaper")
        self._started = True
        log.info(
            "gvisor runtime started: recovered %d (%d stopped), deleted %d containers, "
            "%d slots, %d mounts, %d bundles",
            len(recovered),
            sum(1 for i in recovered.values() if self.is_stopped(i)),
            len(stale),
            len(removed_slots),
            len(unmounted),
            bundles,
        )
        return recovered

    async def close(self) -> None:
        self._started = False
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        await self.pool.close()
        await self.wait_idle()

    async def _reap_loop(self, interval: float = 10.0) -> None:
        """Reaps runsc processes that exited on their own (a sandbox's systrap stubs, a
        sandbox that died): stop/destroy reap what they end, this catches the rest."""
        while True:
            await asyncio.sleep(interval)
            try:
                await asyncio.to_thread(_proc.reap_adopted)
            except Exception as e:  # never let housekeeping die
                log.warning("reaping runsc processes: %s", e)

    async def wait_idle(self) -> None:
        """Awaits the background work started so far (the rest of destroys)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def purge(self) -> None:
        """Removes every trace of this prefix/home from the host: containers, slots, mounts,
        bundles, work dirs, cgroups and the host rules. For tests and uninstall; running
        sandboxes die. Upper dirs (the orchestrator's) are left alone."""
        await self.close()
        await asyncio.to_thread(self.settings.runsc_root.mkdir, parents=True, exist_ok=True)
        await self._delete_containers([str(c.get("id")) for c in await self.runsc.list_states()])
        self._live.clear()
        await self.network.cleanup(keep=set())
        await self._unmount_stale(keep=set())
        await self.rootfs.remove()
        await asyncio.to_thread(self._cleanup_bundles, set())
        await asyncio.to_thread(self._cleanup_cgroups, set(), True)
        await self.network.remove_host()
        # State files runsc could not delete (unreadable ones).
        await asyncio.to_thread(_remove_state_files, self.settings.runsc_root)

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
        if not _ID_RE.fullmatch(spec.sandbox_id):
            raise RuntimeFailure(f"invalid sandbox id {spec.sandbox_id!r}")
        if image_dir is not None and not await asyncio.to_thread(image_dir.is_dir):
            raise RuntimeFailure(f"no checkpoint image at {image_dir}")
        if spec.upper is not None and not await asyncio.to_thread(spec.upper.is_dir):
            raise RuntimeFailure(f"upper dir {spec.upper} does not exist")
        t0 = time.perf_counter()
        held = self._claim_stopped(reuse, spec) if reuse is not None else None
        rearm: asyncio.Task[None] | None = None
        try:
            if held is not None:
                cid = held.container_id
                if await asyncio.to_thread(self.runsc.sandbox_state_file, cid) is not None:
                    # Not deleted yet (see stop) or its delete failed: the slot is ours, the
                    # id is not free. The old container is deleted once this one runs.
                    cid = self._new_cid(spec.sandbox_id)
                slot = self.addressing.slot(held.slot)
                # Puts the slot's address back while the rootfs and bundle are prepared.
                rearm = asyncio.create_task(self.network.rearm(slot.index))
                rearm.add_done_callback(_retrieve)
            else:
                cid = self._new_cid(spec.sandbox_id)
                slot = await self.pool.acquire()
        except BaseException:
            if held is not None:
                self._busy.discard(held.container_id)
            raise
        inst = self._new_instance(spec, cid, slot)
        if held is not None:
            self._live.pop(held.container_id, None)
        self._live[cid] = inst
        try:
            t1 = await self._boot(
                spec, inst, slot, image_dir, fresh_bundle=held is None, before_runsc=rearm
            )
        except BaseException:
            if rearm is not None and not rearm.done():
                rearm.cancel()
            self._live.pop(cid, None)
            if held is None:
                task = self._spawn(self._finish(inst, owned=True))
            else:
                task = self._spawn(self._unlaunch(inst, held))
            with contextlib.suppress(Exception):
                await asyncio.shield(task)
            raise
        finally:
            if held is not None:
                self._busy.discard(held.container_id)
        if held is not None and held.container_id != cid:
            self._spawn(self._discard_container(held))
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
        return inst

    def _new_cid(self, sandbox_id: str) -> str:
        cid = f"{sandbox_id}-{secrets.token_hex(4)}"
        if len(str(self.settings.runsc_root / f"runsc-{cid}.sock")) > _MAX_SOCKET_PATH:
            raise RuntimeFailure(
                f"sandbox id {sandbox_id!r} too long for a runsc control socket under "
                f"{self.settings.runsc_root}"
            )
        return cid

    def _new_instance(self, spec: SandboxSpec, cid: str, slot: Slot) -> Instance:
        bundle = self.settings.sandboxes_dir / spec.sandbox_id / cid
        extra: dict[str, Any] = {
            "rootfs_key": None,
            "overlay": OVERLAY_MEMORY if spec.upper is None else OVERLAY_NONE,
            "cpu_count": spec.cpu_count,
            "memory_mb": spec.memory_mb,
            "cgroup": self._cgroup_path(cid),
        }
        if spec.upper is not None:
            extra.update(
                upper=str(spec.upper),
                workdir=str(spec.upper.parent / f"work-{cid}"),
                rootfs_mount=str(bundle / "rootfs"),
            )
        return Instance(
            sandbox_id=spec.sandbox_id,
            container_id=cid,
            address=slot.router_ip,
            slot=slot.index,
            bundle_dir=bundle,
            extra=extra,
        )

    def _claim_stopped(self, reuse: Instance, spec: SandboxSpec) -> Instance:
        """The runtime's own record of the stopped instance `reuse`, marked busy."""
        cid = reuse.container_id
        held = self._live.get(cid)
        if held is None or not self.is_stopped(held):
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
        inst: Instance,
        slot: Slot,
        image_dir: Path | None,
        *,
        fresh_bundle: bool,
        before_runsc: asyncio.Task[None] | None = None,
    ) -> float:
        """Bundle, rootfs and `runsc run/restore`; returns when runsc started (perf counter).
        `before_runsc` (network work started by the caller) is awaited before runsc runs."""
        cid, bundle = inst.container_id, inst.bundle_dir
        # instance.json first: a crash from here on leaves what reconcile needs to clean up.
        await asyncio.to_thread(_make_bundle, inst, fresh_bundle)
        if spec.upper is not None:
            target = Path(inst.extra["rootfs_mount"])
            await rootfs.mount_writable(
                spec.layers, spec.upper, Path(inst.extra["workdir"]), target
            )
            root = target
        else:
            root, key = await self.rootfs.acquire(spec.layers, cid)
            inst.extra["rootfs_key"] = key
        cfg = oci.config(
            spec, rootfs=root, netns_path=slot.netns_path, cgroups_path=self._cgroup_path(cid)
        )
        await asyncio.to_thread(_write_config, bundle, cfg)
        await asyncio.to_thread(_write_instance, inst)
        if before_runsc is not None:
            await before_runsc
        t1 = time.perf_counter()
        if image_dir is None:
            args = ["run", "--detach", f"--bundle={bundle}", cid]
        else:
            inst.extra["restored_from"] = str(image_dir)
            args = [
                "restore",
                "--detach",
                f"--bundle={bundle}",
                f"--image-path={image_dir}",
                cid,
            ]
        await self.runsc.detached(
            *args,
            output=bundle / "console.log",
            log_dir=bundle,
            time_limit=600,
            overlay=inst.extra["overlay"],
        )
        pid, gofer = self.runsc.read_pids(cid)
        inst.extra.update(pid=pid, gofer_pid=gofer, started_at=time.time())
        await asyncio.to_thread(_write_instance, inst)
        sample = await asyncio.to_thread(self._read_cgroup, inst)
        if sample is not None:  # CPU baseline: the first stats() covers the time since now
            self._cpu_samples[cid] = (time.monotonic(), sample[0])
        return t1

    async def _unlaunch(self, inst: Instance, held: Instance) -> None:
        """A failed start of a stopped sandbox: removes what it made, keeps the slot and puts
        the stopped instance back, so the caller can retry or destroy it."""
        await self._remove_container(inst, kill=True)
        await self._release_rootfs(inst)
        if inst.bundle_dir != held.bundle_dir:
            await asyncio.to_thread(_remove_bundle, inst.bundle_dir)
        await asyncio.to_thread(_write_instance, held)
        self._live[held.container_id] = held

    async def _discard_container(self, old: Instance) -> None:
        """The leftover container and bundle of a stopped sandbox that was started again
        under a new id (its slot now belongs to the new container)."""
        await self._remove_container(old, kill=True)
        await asyncio.to_thread(_remove_bundle, old.bundle_dir)

    async def stop(self, inst: Instance) -> None:
        cid = inst.container_id
        held = self._live.get(cid)
        if held is not None and self.is_stopped(held):
            inst.extra.update(held.extra)
            return
        if held is None or cid in self._destroying:
            raise RuntimeFailure(f"container {cid} is not a sandbox of this runtime")
        if cid in self._busy:
            raise RuntimeFailure(f"container {cid} is busy")
        self._busy.add(cid)
        t0 = time.perf_counter()
        try:
            checkpointed = bool(held.extra.get("checkpointed"))
            # After a checkpoint the sandbox exits by itself; its `runsc delete` is left to
            # the next start (under a new id) or to destroy, off the snapshot's path.
            await self._remove_container(held, kill=not checkpointed, delete=not checkpointed)
            await self._release_rootfs(held)
            held.extra.update(
                stopped=True, pid=0, gofer_pid=0, rootfs_key=None, stopped_at=time.time()
            )
            held.extra.pop("checkpointed", None)
            await asyncio.to_thread(_write_instance, held)
            self._cpu_samples.pop(cid, None)
        finally:
            self._busy.discard(cid)
        if held is not inst:
            inst.extra.clear()
            inst.extra.update(held.extra)
        log.info("stopped %s in %.0f ms", cid, (time.perf_counter() - t0) * 1000)

    async def _remove_container(self, inst: Instance, *, kill: bool, delete: bool = True) -> None:
        """Kills (unless it exits by itself after a checkpoint) and deletes (unless not
        `delete`) the container, and waits until its sandbox and gofer processes are gone (so
        nothing holds its rootfs).

        Both exits are reaped before `runsc delete`, which otherwise polls each zombie (up to
        5 s) until init reaps it. The gofer exits by itself once the sandbox is gone."""
        cid = inst.container_id
        pid = int(inst.extra.get("pid") or 0)
        gofer = int(inst.extra.get("gofer_pid") or 0)
        if pid <= 0:
            pid, gofer = self.runsc.read_pids(cid)

        def running() -> list[int]:
            """The container's processes that (may) still run, verified."""
            found = []
            if pid > 0 and (self._is_our_sandbox(pid, cid) or _is_runsc_child(pid)):
                found.append(pid)
            if gofer > 0 and (self._is_our_gofer(gofer, inst) or _is_runsc_child(gofer)):
                found.append(gofer)
            return found

        procs = await asyncio.to_thread(running)
        if kill and pid in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if procs and not await _proc.wait_exited(procs, 10.0):
            left = await asyncio.to_thread(running)
            log.warning("processes %s of %s did not exit; killing them", left, cid)
            for p in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            await _proc.wait_exited(left, 10.0)
        if not delete:
            return
        try:
            await self.runsc.delete(cid)
        except RuntimeFailure as e:
            log.warning("runsc delete %s: %s", cid, e)
        await asyncio.to_thread(_proc.reap_adopted)

    async def _release_rootfs(self, inst: Instance) -> None:
        """Unmounts a writable overlay (and removes its work dir, never `upper`), or drops the
        reference to a shared read-only stack."""
        mnt = inst.extra.get("rootfs_mount")
        if mnt and not self.is_stopped(inst):
            if await rootfs.unmount(Path(str(mnt))):
                work = inst.extra.get("workdir")
                if work:
                    await asyncio.to_thread(rootfs.remove_work_dir, Path(str(work)))
            else:
                log.warning("could not unmount %s", mnt)
        await self.rootfs.release(inst.extra.get("rootfs_key"), inst.container_id)

    async def destroy(self, inst: Instance) -> None:
        cid = inst.container_id
        if cid in self._destroying:
            return
        held = self._live.pop(cid, None)
        owned = held is not None
        if held is not None:
            inst = held
        self._destroying.add(cid)
        if not self.is_stopped(inst):
            try:
                self._kill_sandbox(inst)
            except OSError as e:
                log.warning("killing sandbox %s: %s", cid, e)
        task = self._spawn(self._finish(inst, owned=owned))
        task.add_done_callback(lambda _t: self._destroying.discard(cid))

    async def _finish(self, inst: Instance, *, owned: bool) -> None:
        """Everything of a container after its sandbox was killed (or failed to start, or was
        stopped)."""
        cid = inst.container_id
        t0 = time.perf_counter()
        if not self.is_stopped(inst):
            await self._remove_container(inst, kill=True)
        elif await asyncio.to_thread(self.runsc.sandbox_state_file, cid) is not None:
            await self._remove_container(inst, kill=True)  # stopped, delete left for later
        if owned:
            await gather_quiet(self.pool.release(inst.slot), self._release_rootfs(inst))
        elif inst.extra.get("rootfs_mount") and not self.is_stopped(inst):
            # Not ours (a record from before a restart that start() did not recover): its
            # mount, if any, is ours to remove all the same.
            await self._release_rootfs(inst)
        await asyncio.to_thread(_remove_bundle, inst.bundle_dir)
        self._cpu_samples.pop(cid, None)
        log.debug("finished %s in %.0f ms", cid, (time.perf_counter() - t0) * 1000)

    def _kill_sandbox(self, inst: Instance) -> bool:
        """SIGKILLs the container's sandbox process (verified by its command line)."""
        cid = inst.container_id
        pid = int(inst.extra.get("pid") or 0) or self.runsc.read_pids(cid)[0]
        if pid <= 0 or not self._is_our_sandbox(pid, cid):
            return False
        self._unfreeze(cid, self._cgroup(inst))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return True

    def _is_our_sandbox(self, pid: int, cid: str) -> bool:
        argv = _cmdline(pid)
        return (
            bool(argv)
            and argv[0] == "runsc-sandbox"
            and argv[-1] == cid
            and f"--root={self.settings.runsc_root}" in argv
        )

    def _is_our_gofer(self, pid: int, inst: Instance) -> bool:
        argv = _cmdline(pid)
        return (
            bool(argv)
            and argv[0] == "runsc-gofer"
            and f"--root={self.settings.runsc_root}" in argv
            and f"--bundle={inst.bundle_dir}" in argv
        )

    def _check_not_stopped(self, inst: Instance) -> None:
        held = self._live.get(inst.container_id, inst)
        if self.is_stopped(held):
            raise RuntimeFailure(f"container {inst.container_id} is stopped")

    async def freeze(self, inst: Instance) -> None:
        self._check_not_stopped(inst)
        cgroup = self._cgroup(inst)
        if await asyncio.to_thread(self.freezer.available, cgroup):
            await asyncio.to_thread(self.freezer.freeze, cgroup)
        else:
            await self.runsc.pause(inst.container_id)

    async def thaw(self, inst: Instance) -> None:
        self._check_not_stopped(inst)
        cgroup = self._cgroup(inst)
        if await asyncio.to_thread(self.freezer.is_frozen, cgroup):
            await asyncio.to_thread(self.freezer.thaw, cgroup)
        else:  # paused by runsc (no freezer on this host)
            await self.runsc.resume(inst.container_id)

    def _unfreeze(self, cid: str, cgroup: str | None = None) -> None:
        """Thaws a frozen container: runsc commands and even SIGKILL wait on frozen tasks."""
        cg = cgroup or self._cgroup_path(cid)
        if self.freezer.is_frozen(cg):
            self.freezer.thaw(cg)

    def _cgroup(self, inst: Instance) -> str:
        return str(inst.extra.get("cgroup") or self._cgroup_path(inst.container_id))

    async def checkpoint(self, inst: Instance, image_dir: Path, *, leave_running: bool) -> None:
        self._check_not_stopped(inst)
        await asyncio.to_thread(image_dir.mkdir, parents=True, exist_ok=True)
        t0 = time.perf_counter()
        # A frozen sandbox is checkpointed as it stands: runsc stops its tasks first thing.
        await asyncio.to_thread(self._unfreeze, inst.container_id, self._cgroup(inst))
        await self._drop_connections(inst)
        await self.runsc.checkpoint(
            inst.container_id,
            image_dir,
            leave_running=leave_running,
            log_dir=inst.bundle_dir if inst.bundle_dir.is_dir() else None,
            overlay=str(inst.extra.get("overlay") or OVERLAY_MEMORY),
        )
        if not leave_running:
            # The sandbox exits, though `runsc state` may still say running for a while.
            inst.extra["checkpointed"] = True
            held = self._live.get(inst.container_id)
            if held is not None:
                held.extra["checkpointed"] = True
        log.info(
            "checkpointed %s to %s in %.0f ms",
            inst.container_id,
            image_dir,
            (time.perf_counter() - t0) * 1000,
        )

    async def _drop_connections(self, inst: Instance) -> None:
        """Aborts the host's TCP connections to the sandbox (the node's own: envd client,
        proxy) before a checkpoint. runsc 20240729 restores a sandbox that had an open
        connection at checkpoint time with a wedged netstack (the listener never accepts
        again); the connections would be dropped at restore anyway (--net-disconnect-ok)."""
        try:
            await _proc.run(["ss", "-K", "dst", inst.address], time_limit=10)
        except RuntimeFailure as e:
            log.warning("could not drop connections to %s: %s", inst.address, e)

    async def alive(self, inst: Instance) -> bool:
        cid = inst.container_id
        held = self._live.get(cid, inst)
        if (
            inst.extra.get("checkpointed")
            or self.is_stopped(inst)
            or self.is_stopped(held)
            or cid in self._destroying
        ):
            return False
        # The sandbox process exits with the root container's init (a zombie until reaped,
        # which is when `runsc state` notices), so its command line is the fast answer.
        pid = int(inst.extra.get("pid") or 0)
        if pid > 0:
            return await asyncio.to_thread(self._is_our_sandbox, pid, cid)
        state = await self.runsc.state(cid)
        return state is not None and state.get("status") in RUNNING_STATES

    async def stats(self, inst: Instance) -> Stats:
        cid = inst.container_id
        sample = await asyncio.to_thread(self._read_cgroup, inst)
        if sample is None:
            sample = await self._read_events(cid)
        cpu_ns, mem_used, mem_limit = sample
        now = time.monotonic()
        cpus = max(1, int(inst.extra.get("cpu_count") or 1))
        prev = self._cpu_samples.get(cid)
        self._cpu_samples[cid] = (now, cpu_ns)
        if prev is not None and now > prev[0]:
            pct = (cpu_ns - prev[1]) / 1e9 / (now - prev[0]) / cpus * 100
        else:
            # First sample: the average since the sandbox started.
            started = float(inst.extra.get("started_at") or 0)
            elapsed = time.time() - started if started else 0.0
            pct = cpu_ns / 1e9 / elapsed / cpus * 100 if elapsed > 0 else 0.0
        if mem_limit <= 0 or mem_limit >= 1 << 62:
            mem_limit = int(inst.extra.get("memory_mb") or 0) * 1024 * 1024
        rss = await asyncio.to_thread(self._host_rss, inst)
        return Stats(
            cpu_used_pct=round(max(0.0, min(pct, 100.0)), 2),
            mem_used_bytes=mem_used,
            mem_total_bytes=mem_limit,
            rss_bytes=rss,
        )

    # Helpers -----------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)
        return task

    def _slot_exists(self, n: int) -> bool:
        a = self.addressing
        return (
            all((NETNS_DIR / ns).exists() for ns in (a.router_ns(n), a.inner_ns(n)))
            and (SYS_NET / a.host_if(n)).exists()
        )

    def _cgroup_path(self, cid: str) -> str:
        return f"/{self.settings.net_prefix}/{cid}"

    async def _kill_containers(self, cids: list[str]) -> None:
        """SIGKILLs the containers' sandbox processes and waits (briefly) until they and
        their gofers are dead, so their mounts and netns can go; reaping may come later."""
        pids: list[int] = []
        for cid in cids:
            await asyncio.to_thread(self._unfreeze, cid)
            pid, gofer = self.runsc.read_pids(cid)
            if pid > 0 and self._is_our_sandbox(pid, cid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                pids += [p for p in (pid, gofer) if p > 0]
        deadline = time.monotonic() + 5.0
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if not _proc.settled(p)]
            if pids:
                await asyncio.sleep(0.02)

    async def _delete_containers(self, cids: list[str]) -> None:
        """Kills and deletes containers (concurrently, a few at a time)."""
        sem = asyncio.Semaphore(8)

        async def one(cid: str) -> None:
            async with sem:
                await asyncio.to_thread(self._unfreeze, cid)
                pid, gofer = self.runsc.read_pids(cid)
                if pid > 0 and self._is_our_sandbox(pid, cid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                # Reaped first, or `runsc delete` waits for init to reap them (children of
                # this process only when it started them: not after a restart).
                children = [p for p in (pid, gofer) if p > 0 and _is_runsc_child(p)]
                if children:
                    await _proc.wait_exited(children, 5.0)
                await self.runsc.delete(cid)

        await gather_quiet(*(one(c) for c in cids))
        await asyncio.to_thread(_proc.reap_adopted)

    async def _unmount_stale(self, keep: set[Path]) -> list[str]:
        """Unmounts every mount below the sandboxes dir (writable rootfs overlays) but `keep`."""
        removed: list[str] = []
        root = self.settings.sandboxes_dir
        if not await asyncio.to_thread(root.is_dir):
            return removed
        for mp in await asyncio.to_thread(rootfs.mount_points, root):
            if mp in keep:
                continue
            if await rootfs.unmount(mp):
                removed.append(str(mp))
            else:
                log.warning("stale rootfs mount %s could not be removed", mp)
        return removed

    def _find_stopped(self, cid: str) -> Instance | None:
        """A stopped instance's record from its bundle dir, or None."""
        root = self.settings.sandboxes_dir
        if not _ID_RE.fullmatch(cid) or not root.is_dir():
            return None
        for bundle in root.glob(f"*/{cid}"):
            inst = _load_instance(bundle)
            if (
                inst is not None
                and inst.container_id == cid
                and inst.bundle_dir == bundle
                and self.is_stopped(inst)
            ):
                return inst
        return None

    def _read_cgroup(self, inst: Instance) -> tuple[int, int, int] | None:
        """(cpu ns, memory used, memory limit) from the container's cgroup, v1 or v2."""
        rel = str(inst.extra.get("cgroup") or self._cgroup_path(inst.container_id)).lstrip("/")
        v1_cpu = CGROUP_ROOT / "cpuacct" / rel / "cpuacct.usage"
        v1_mem = CGROUP_ROOT / "memory" / rel
        try:
            if v1_cpu.exists():
                cpu = int(v1_cpu.read_text())
                used = int((v1_mem / "memory.usage_in_bytes").read_text())
                stat = _kv((v1_mem / "memory.stat").read_text())
                used -= stat.get("total_inactive_file", 0)
                limit = int((v1_mem / "memory.limit_in_bytes").read_text())
                return cpu, max(0, used), limit
            v2 = CGROUP_ROOT / rel
            if (v2 / "cpu.stat").exists():
                cpu = _kv((v2 / "cpu.stat").read_text()).get("usage_usec", 0) * 1000
                used = int((v2 / "memory.current").read_text())
                used -= _kv((v2 / "memory.stat").read_text()).get("inactive_file", 0)
                raw = (v2 / "memory.max").read_text().strip()
                limit = 0 if raw == "max" else int(raw)
                return cpu, max(0, used), limit
        except (OSError, ValueError):
            return None
        return None

    async def _read_events(self, cid: str) -> tuple[int, int, int]:
        try:
            data = (await self.runsc.events_stats(cid)).get("data") or {}
        except RuntimeFailure as e:
            if is_missing(e):
                raise RuntimeFailure(f"container {cid} does not exist") from e
            raise
        cpu = int(((data.get("cpu") or {}).get("usage") or {}).get("total") or 0)
        mem = (data.get("memory") or {}).get("usage") or {}
        return cpu, int(mem.get("usage") or 0), int(mem.get("limit") or 0)

    def _host_rss(self, inst: Instance) -> int:
        total = 0
        for key in ("pid", "gofer_pid"):
            pid = int(inst.extra.get(key) or 0)
            if pid <= 0:
                continue
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except (OSError, ValueError):
                continue
        return total

    def _cleanup_bundles(self, keep: set[str]) -> int:
        """Removes bundle dirs (and the overlay work dirs they name) of containers not in
        `keep`, and empty sandbox dirs. Mounts below must be gone (see `_unmount_stale`)."""
        removed = 0
        root = self.settings.sandboxes_dir
        if not root.is_dir():
            return 0
        for sandbox_dir in root.iterdir():
            if not sandbox_dir.is_dir() or sandbox_dir.is_symlink():
                continue
            for bundle in sandbox_dir.iterdir():
                if (
                    bundle.name not in keep
                    and bundle.is_dir()
                    and not bundle.is_symlink()
                    and any((bundle / m).exists() for m in _BUNDLE_MARKERS)
                ):
                    inst = _load_instance(bundle)
                    work = inst.extra.get("workdir") if inst is not None else None
                    if work and Path(str(work)).name == f"work-{bundle.name}":
                        rootfs.remove_work_dir(Path(str(work)))
                    _remove_bundle(bundle)
                    removed += 1
            with contextlib.suppress(OSError):
                sandbox_dir.rmdir()
        return removed

    def _cleanup_cgroups(self, keep: set[str], remove_parent: bool) -> None:
        """Removes leftover (empty) cgroups of our containers not in `keep`."""
        prefix = self.settings.net_prefix
        parents = [*CGROUP_ROOT.glob(f"*/{prefix}"), CGROUP_ROOT / prefix]
        for parent in parents:
            if not parent.is_dir():
                continue
            for child in parent.iterdir():
                if child.is_dir() and child.name not in keep:
                    with contextlib.suppress(OSError):
                        child.rmdir()
            if remove_parent:
                with contextlib.suppress(OSError):
                    parent.rmdir()


def _kv(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _is_runsc_child(pid: int) -> bool:
    """A runsc process (sandbox, gofer) this process adopted, e.g. already a zombie."""
    st = _proc.proc_stat(pid)
    return st is not None and st.ppid == os.getpid() and st.comm == _proc.RUNSC_COMM


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _make_bundle(inst: Instance, fresh: bool) -> None:
    """Creates the bundle dir (or, for a stopped container started again, reuses it) and
    writes instance.json."""
    inst.bundle_dir.mkdir(parents=True, exist_ok=not fresh)
    (inst.bundle_dir / "config.json").unlink(missing_ok=True)
    _write_instance(inst)


def _write_config(bundle: Path, cfg: dict[str, Any]) -> None:
    (bundle / "config.json").write_text(json.dumps(cfg, indent=1))


def _write_instance(inst: Instance) -> None:
    tmp = inst.bundle_dir / "instance.json.tmp"
    tmp.write_text(json.dumps(inst.to_json(), indent=1))
    tmp.replace(inst.bundle_dir / "instance.json")


def _load_instance(bundle: Path) -> Instance | None:
    try:
        return Instance.from_json(json.loads((bundle / "instance.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remove_bundle(bundle: Path) -> None:
    """Removes a bundle dir, unless something is still mounted below it (a recursive delete
    through a rootfs overlay would delete the sandbox's files in its upper dir)."""
    if not bundle.is_dir() or bundle.is_symlink():
        return
    if rootfs.mount_points(bundle) or rootfs.is_mount_point(bundle):
        log.warning("not removing %s: something is still mounted below it", bundle)
        return
    shutil.rmtree(bundle, ignore_errors=True)
    with contextlib.suppress(OSError):
        bundle.parent.rmdir()  # the sandbox dir, when this was its last container


def _remove_state_files(root: Path) -> None:
    if root.is_dir():
        for p in root.iterdir():
            if p.is_file() or p.is_socket():
                with contextlib.suppress(OSError):
                    p.unlink()


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Marks a task's exception as seen (whoever awaits it gets it; nobody else logs it)."""
    if not task.cancelled():
        task.exception()


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("background runtime task failed: %s", task.exception())
