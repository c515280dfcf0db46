"""The gVisor (`runsc`) backend: the default, and the one that can checkpoint and fork.

Per container (a sandbox has one; a restore makes a new one with a new id):

    $AENV_HOME/sandboxes/<sandbox_id>/<container_id>/
        config.json     OCI spec generated here (rootfs, mounts, netns of the slot, limits)
        instance.json   the `Instance` (what `start()` recovers after a restart)
        console.log     stdio of `runsc run/restore` and of the sandbox's init process
        runsc.log       runsc's own log (errors); `debug/` with full logs when debug is on

* rootfs: `root.path` is the layer (one layer) or a shared read-only overlay of the stack
  (`rootfs.py`); `--overlay2=root:memory` keeps the sandbox's writes in the sentry's memory,
  so they are part of every checkpoint and the layers are never written.
* network: one slot (`network.py`) per container; the instance's address is the router address.
* limits: `linux.resources` + `linux.cgroupsPath=/<net_prefix>/<container_id>` (runsc creates
  the cgroups; on this host's cgroup v1 hierarchies, memory and cpu quota apply to the sandbox
  and gofer processes; exceeding the memory limit OOM-kills the whole sandbox, not the host).
* destroy: the awaited part only SIGKILLs the sandbox process (it stops serving at once);
  `runsc delete`, slot teardown, unmount and bundle removal finish in a tracked background task
  that `close()` awaits.
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
from aenv.runtime import oci
from aenv.runtime.base import Instance, Runtime, SandboxSpec, Stats
from aenv.runtime.network import NETNS_DIR, SYS_NET, Network, SlotAddressing, SlotPool
from aenv.runtime.rootfs import RootfsMounts
from aenv.runtime.runsc import RUNNING_STATES, Runsc, gather_quiet, is_missing

log = logging.getLogger("aenv.runtime")

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,100}")
_BUNDLE_MARKERS = ("instance.json", "config.json")
CGROUP_ROOT = Path("/sys/fs/cgroup")
_MAX_SOCKET_PATH = 107  # runsc's control socket `<root>/runsc-<id>.sock` (sun_path)


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
            overlay="root:memory",
            debug=debug,
        )
        self.network = Network(self.addressing)
        self.pool = SlotPool(self.network, settings.net_pool_size)
        self.rootfs = RootfsMounts(settings.home / "mnt")
        # Containers whose slot and rootfs reference this object holds.
        self._live: dict[str, Instance] = {}
        self._destroying: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cpu_samples: dict[str, tuple[float, int]] = {}
        self._started = False

    # Lifecycle of the backend ------------------------------------------------------------

    async def start(self, keep: set[str]) -> dict[str, Instance]:
        s = self.settings
        for d in (s.runsc_root, s.sandboxes_dir):
            await asyncio.to_thread(d.mkdir, parents=True, exist_ok=True)
        await self.runsc.probe()
        await self.rootfs.prepare()
        await self.network.setup_host()

        recovered: dict[str, Instance] = {}
        stale: list[str] = []
        for c in await self.runsc.list():
            cid = str(c.get("id"))
            inst = None
            if cid in keep and c.get("status") in RUNNING_STATES:
                inst = await asyncio.to_thread(_load_instance, Path(str(c.get("bundle"))))
            if (
                inst is not None
                and inst.container_id == cid
                and await self.alive(inst)
                and await asyncio.to_thread(self._slot_exists, inst.slot)
            ):
                recovered[cid] = inst
            else:
                stale.append(cid)
        await self._delete_containers(stale)

        slots = {inst.slot for inst in recovered.values()}
        removed_slots = await self.network.cleanup(keep=slots)
        keys: dict[str, set[str]] = {}
        for cid, inst in recovered.items():
            key = inst.extra.get("rootfs_key")
            if key:
                keys.setdefault(str(key), set()).add(cid)
        unmounted = await self.rootfs.cleanup(keep=set(keys))
        for key, owners in keys.items():
            for cid in owners:
                self.rootfs.adopt(key, cid)
        bundles = await asyncio.to_thread(self._cleanup_bundles, set(recovered))
        await asyncio.to_thread(self._cleanup_cgroups, set(recovered), False)

        self._live = dict(recovered)
        self.pool.start(reserved=slots)
        self._started = True
        log.info(
            "gvisor runtime started: recovered %d, deleted %d containers, %d slots, "
            "%d mounts, %d bundles",
            len(recovered),
            len(stale),
            len(removed_slots),
            len(unmounted),
            bundles,
        )
        return recovered

    async def close(self) -> None:
        self._started = False
        await self.pool.close()
        await self.wait_idle()

    async def wait_idle(self) -> None:
        """Awaits the background work started so far (the rest of destroys)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def purge(self) -> None:
        """Removes every trace of this prefix/home from the host: containers, slots, mounts,
        bundles, cgroups and the host rules. For tests and uninstall; running sandboxes die."""
        await self.close()
        await asyncio.to_thread(self.settings.runsc_root.mkdir, parents=True, exist_ok=True)
        await self._delete_containers([str(c.get("id")) for c in await self.runsc.list()])
        self._live.clear()
        await self.network.cleanup(keep=set())
        await self.rootfs.remove()
        await asyncio.to_thread(self._cleanup_bundles, set())
        await asyncio.to_thread(self._cleanup_cgroups, set(), True)
        await self.network.remove_host()
        # State files runsc could not delete (unreadable ones).
        await asyncio.to_thread(_remove_state_files, self.settings.runsc_root)

    # Sandboxes ---------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> Instance:
        return await self._launch(spec, image_dir=None)

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> Instance:
        return await self._launch(spec, image_dir=image_dir)

    async def _launch(self, spec: SandboxSpec, image_dir: Path | None) -> Instance:
        if not self._started:
            raise RuntimeFailure("the gvisor runtime is not started")
        if not _ID_RE.fullmatch(spec.sandbox_id):
            raise RuntimeFailure(f"invalid sandbox id {spec.sandbox_id!r}")
        if image_dir is not None and not await asyncio.to_thread(image_dir.is_dir):
            raise RuntimeFailure(f"no checkpoint image at {image_dir}")
        cid = f"{spec.sandbox_id}-{secrets.token_hex(4)}"
        bundle = self.settings.sandboxes_dir / spec.sandbox_id / cid
        if len(str(self.settings.runsc_root / f"runsc-{cid}.sock")) > _MAX_SOCKET_PATH:
            raise RuntimeFailure(
                f"sandbox id {spec.sandbox_id!r} too long for a runsc control socket under "
                f"{self.settings.runsc_root}"
            )
        t0 = time.perf_counter()
        slot = await self.pool.acquire()
        inst = Instance(
            sandbox_id=spec.sandbox_id,
            container_id=cid,
            address=slot.router_ip,
            slot=slot.index,
            bundle_dir=bundle,
            extra={
                "rootfs_key": None,
                "cpu_count": spec.cpu_count,
                "memory_mb": spec.memory_mb,
                "cgroup": self._cgroup_path(cid),
            },
        )
        self._live[cid] = inst
        try:
            rootfs, key = await self.rootfs.acquire(spec.layers, cid)
            inst.extra["rootfs_key"] = key
            cfg = oci.config(
                spec,
                rootfs=rootfs,
                netns_path=slot.netns_path,
                cgroups_path=self._cgroup_path(cid),
            )
            await asyncio.to_thread(_write_bundle, bundle, cfg, inst)
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
                *args, output=bundle / "console.log", log_dir=bundle, time_limit=600
            )
            pid, gofer = self.runsc.read_pids(cid)
            inst.extra.update(pid=pid, gofer_pid=gofer, started_at=time.time())
            await asyncio.to_thread(_write_instance, inst)
            sample = await asyncio.to_thread(self._read_cgroup, inst)
            if sample is not None:  # CPU baseline: the first stats() covers the time since now
                self._cpu_samples[cid] = (time.monotonic(), sample[0])
        except BaseException:
            self._live.pop(cid, None)
            task = self._spawn(self._finish(inst, owned=True))
            with contextlib.suppress(Exception):
                await asyncio.shield(task)
            raise
        log.info(
            "%s %s in slot %d at %s: %.0f ms (runsc %.0f ms)",
            "restored" if image_dir else "created",
            cid,
            slot.index,
            slot.router_ip,
            (time.perf_counter() - t0) * 1000,
            (time.perf_counter() - t1) * 1000,
        )
        return inst

    async def destroy(self, inst: Instance) -> None:
        cid = inst.container_id
        if cid in self._destroying:
            return
        owned = self._live.pop(cid, None) is not None
        self._destroying.add(cid)
        try:
            self._kill_sandbox(inst)
        except OSError as e:
            log.warning("killing sandbox %s: %s", cid, e)
        task = self._spawn(self._finish(inst, owned=owned))
        task.add_done_callback(lambda _t: self._destroying.discard(cid))

    async def _finish(self, inst: Instance, *, owned: bool) -> None:
        """Everything of a container after its sandbox was killed (or failed to start)."""
        cid = inst.container_id
        t0 = time.perf_counter()
        try:
            await self.runsc.delete(cid)
        except RuntimeFailure as e:
            log.warning("runsc delete %s: %s", cid, e)
        if owned:
            await gather_quiet(
                self.pool.release(inst.slot),
                self.rootfs.release(inst.extra.get("rootfs_key"), cid),
            )
        await asyncio.to_thread(_remove_bundle, inst.bundle_dir)
        self._cpu_samples.pop(cid, None)
        log.debug("finished %s in %.0f ms", cid, (time.perf_counter() - t0) * 1000)

    def _kill_sandbox(self, inst: Instance) -> bool:
        """SIGKILLs the container's sandbox process (verified by its command line)."""
        cid = inst.container_id
        pid = int(inst.extra.get("pid") or 0) or self.runsc.read_pids(cid)[0]
        if pid <= 0 or not self._is_our_sandbox(pid, cid):
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return True

    def _is_our_sandbox(self, pid: int, cid: str) -> bool:
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
        return (
            bool(argv)
            and argv[0] == "runsc-sandbox"
            and argv[-1] == cid
            and f"--root={self.settings.runsc_root}" in argv
        )

    async def freeze(self, inst: Instance) -> None:
        await self.runsc.pause(inst.container_id)

    async def thaw(self, inst: Instance) -> None:
        await self.runsc.resume(inst.container_id)

    async def checkpoint(self, inst: Instance, image_dir: Path, *, leave_running: bool) -> None:
        await asyncio.to_thread(image_dir.mkdir, parents=True, exist_ok=True)
        t0 = time.perf_counter()
        await self.runsc.checkpoint(
            inst.container_id,
            image_dir,
            leave_running=leave_running,
            log_dir=inst.bundle_dir if inst.bundle_dir.is_dir() else None,
        )
        if not leave_running:
            # The sandbox exits, though `runsc state` may still say running for a while.
            inst.extra["checkpointed"] = True
        log.info(
            "checkpointed %s to %s in %.0f ms",
            inst.container_id,
            image_dir,
            (time.perf_counter() - t0) * 1000,
        )

    async def alive(self, inst: Instance) -> bool:
        cid = inst.container_id
        if inst.extra.get("checkpointed") or cid in self._destroying:
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

    async def _delete_containers(self, cids: list[str]) -> None:
        """Kills and deletes containers (concurrently, a few at a time)."""
        sem = asyncio.Semaphore(8)

        async def one(cid: str) -> None:
            async with sem:
                pid, _ = self.runsc.read_pids(cid)
                if pid > 0 and self._is_our_sandbox(pid, cid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                await self.runsc.delete(cid)

        await gather_quiet(*(one(c) for c in cids))

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
        """Removes bundle dirs of containers not in `keep`, and empty sandbox dirs."""
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


def _write_bundle(bundle: Path, cfg: dict[str, Any], inst: Instance) -> None:
    bundle.mkdir(parents=True, exist_ok=False)
    (bundle / "config.json").write_text(json.dumps(cfg, indent=1))
    _write_instance(inst)


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
    shutil.rmtree(bundle, ignore_errors=True)
    with contextlib.suppress(OSError):
        bundle.parent.rmdir()  # the sandbox dir, when this was its last container


def _remove_state_files(root: Path) -> None:
    if root.is_dir():
        for p in root.iterdir():
            if p.is_file() or p.is_socket():
                with contextlib.suppress(OSError):
                    p.unlink()


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("background runtime task failed: %s", task.exception())
