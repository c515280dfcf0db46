"""After a crash or restart: which containers the host still runs (or holds stopped) that
the catalog wants back, and removal of every other trace of this node on the host."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from aenv.config import Settings
from aenv.runtime import rootfs
from aenv.runtime.freezer import CGROUP_ROOT
from aenv.runtime.gvisor import bundles
from aenv.runtime.gvisor.container import Container
from aenv.runtime.gvisor.processes import Processes
from aenv.runtime.gvisor.runsc import RUNNING_STATES
from aenv.runtime.net.network import NETNS_DIR, SYS_NET, Network, SlotAddressing
from aenv.runtime.rootfs import RootfsMounts

log = logging.getLogger("aenv.runtime")

Spawn = Callable[[Coroutine[Any, Any, None]], object]


class Reconciler:
    def __init__(
        self,
        settings: Settings,
        procs: Processes,
        network: Network,
        addressing: SlotAddressing,
        mounts: RootfsMounts,
    ) -> None:
        self.settings = settings
        self.procs = procs
        self.runsc = procs.runsc
        self.network = network
        self.addressing = addressing
        self.mounts = mounts

    async def recover(self, keep: set[str], spawn: Spawn) -> dict[str, Container]:
        """The containers of `keep` still running with their slot, or stopped with their
        slot; everything else is removed (`spawn` runs the slow part in the background)."""
        recovered: dict[str, Container] = {}
        stale: list[str] = []
        await self.procs.wait_for_commands()
        # Read from runsc's state files: `runsc list` would hang on a frozen (paused) sandbox.
        for st in await self.runsc.list_states():
            cid = str(st.get("id"))
            c = None
            if cid in keep and st.get("status") in RUNNING_STATES:
                c = await asyncio.to_thread(Container.load, Path(str(st.get("bundle"))))
            if (
                c is not None
                and c.id == cid
                and not c.stopped
                and await self.procs.is_running(c)
                and await asyncio.to_thread(self.slot_exists, c.slot)
            ):
                recovered[cid] = c
            else:
                stale.append(cid)
        # Stale containers are killed now; their `runsc delete` can take a minute after a
        # crash (their processes now belong to init, which reaps slowly), so it finishes in
        # the background instead of holding up the server's start.
        await self.procs.kill_all(stale)
        strays = await asyncio.to_thread(self.procs.kill_strays, set(recovered))
        if strays:
            log.warning("killed %d runsc processes of no known container", strays)
        spawn(self.procs.delete_all(stale))
        # Stopped sandboxes (no container, slot kept) the catalog still knows; a container
        # left over from a failed stop was deleted just above.
        root = self.settings.sandboxes_dir
        for cid in sorted(keep - set(recovered)):
            found = await asyncio.to_thread(bundles.find_stopped, root, cid)
            if found is not None and await asyncio.to_thread(self.slot_exists, found.slot):
                recovered[cid] = found

        running = [c for c in recovered.values() if not c.stopped]
        slots = {c.slot for c in recovered.values()}
        removed_slots = await self.network.cleanup(keep=slots)
        # Writable overlays of recovered running sandboxes stay mounted (a mount outlives
        # the server that made it): re-adopted as they are; every other one under the
        # sandboxes dir is stale.
        mounted = {c.rootfs_mount for c in running if c.rootfs_mount is not None}
        unmounted = await self.unmount_stale(keep=mounted)
        for mnt in mounted:
            if not await asyncio.to_thread(rootfs.is_mount_point, mnt):
                log.warning("rootfs overlay %s of a recovered sandbox is not mounted", mnt)
        keys: dict[str, set[str]] = {}
        for c in running:
            if c.rootfs_key:
                keys.setdefault(c.rootfs_key, set()).add(c.id)
        unmounted += await self.mounts.cleanup(keep=set(keys))
        for key, owners in keys.items():
            for cid in owners:
                self.mounts.adopt(key, cid)
        removed = await asyncio.to_thread(bundles.cleanup, root, set(recovered))
        await asyncio.to_thread(self.cleanup_cgroups, set(recovered), False)
        log.info(
            "gvisor runtime started: recovered %d (%d stopped), deleted %d containers, "
            "%d slots, %d mounts, %d bundles",
            len(recovered),
            len(recovered) - len(running),
            len(stale),
            len(removed_slots),
            len(unmounted),
            removed,
        )
        return recovered

    async def purge(self) -> None:
        """Removes every trace of this prefix/home from the host: containers, slots, mounts,
        bundles, work dirs, cgroups and the host rules. Upper dirs are left alone."""
        await asyncio.to_thread(self.settings.runsc_root.mkdir, parents=True, exist_ok=True)
        await self.procs.delete_all([str(c.get("id")) for c in await self.runsc.list_states()])
        await self.network.cleanup(keep=set())
        await self.unmount_stale(keep=set())
        await self.mounts.remove()
        await asyncio.to_thread(bundles.cleanup, self.settings.sandboxes_dir, set())
        await asyncio.to_thread(self.cleanup_cgroups, set(), True)
        await self.network.remove_host()
        # State files runsc could not delete (unreadable ones).
        await asyncio.to_thread(_remove_state_files, self.settings.runsc_root)

    def slot_exists(self, n: int) -> bool:
        a = self.addressing
        return (
            all((NETNS_DIR / ns).exists() for ns in (a.router_ns(n), a.inner_ns(n)))
            and (SYS_NET / a.host_if(n)).exists()
        )

    async def unmount_stale(self, keep: set[Path]) -> list[str]:
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

    def cleanup_cgroups(self, keep: set[str], remove_parent: bool) -> None:
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


def _remove_state_files(root: Path) -> None:
    if root.is_dir():
        for p in root.iterdir():
            if p.is_file() or p.is_socket():
                with contextlib.suppress(OSError):
                    p.unlink()
