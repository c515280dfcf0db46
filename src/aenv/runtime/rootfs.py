"""Root filesystems for sandboxes (decision 2).

Two modes, chosen per sandbox by `SandboxSpec.upper`:

* **Writable host overlay per container** (`upper` set; runsc `--overlay2=none`):
  `lowerdir=<layers, topmost first>,upperdir=<upper>,workdir=<upper's parent>/work-<cid>`
  mounted at the container's bundle `rootfs/` (`mount_writable`). Every rootfs write lands in
  `upper` on the host: regular overlayfs format (whiteouts are 0/0 character devices, opaque
  dirs carry `trusted.overlay.opaque=y`), with redirect_dir/metacopy/index off so a sealed
  upper is a plain layer that stacks under any later one. The layers are never written; the
  runtime never deletes `upper` (the orchestrator owns it), only its own work dir.
* **Read-only shared stack** (`upper` None; runsc `--overlay2=root:memory`): one layer is the
  rootfs itself; several get one read-only host overlay (`lowerdir=l1:l2:...`, no upper) per
  distinct stack under `$AENV_HOME/mnt/<key>`, shared by refcount (`RootfsMounts`). Writes
  land in the sentry's memory overlay (and in checkpoints).

Both are mounted `nosuid,nodev` (`HOST_OPTIONS`): the files are the sandbox's, and the host
must never honour a set-id bit or device node it planted. gVisor implements set-id and devices
inside the sandbox itself, from the file modes, so the sandbox sees no difference.

runsc's sandbox and gofer processes pivot into mount namespaces of their own that hold only
what they serve, so an unmounted stack does not linger in other sandboxes (checked: after an
unmount no process on the host has the overlay in its mountinfo).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
from pathlib import Path

from aenv.errors import RuntimeFailure
from aenv.runtime import _proc

log = logging.getLogger("aenv.runtime")

# The mount(2) data page is 4096 bytes; keep room for "ro,lowerdir=" and friends.
_MAX_OPTION = 3800


def stack_key(layers: list[Path]) -> str:
    h = hashlib.sha256("\n".join(str(p) for p in layers).encode())
    return h.hexdigest()[:24]


def mount_points(under: Path) -> list[Path]:
    """Mount points strictly below `under`, from /proc/self/mountinfo (deepest first)."""
    prefix = str(under).rstrip("/") + "/"
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp.startswith(prefix):
                found.append(Path(mp))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _is_mount_point(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4].replace("\\040", " ") == target for line in f)


def is_mount_point(path: Path) -> bool:
    return _is_mount_point(path)


def _lowerdir(layers: list[Path], reserve: int = 0) -> tuple[str, str | None]:
    """The `lowerdir=` value and the cwd to mount from (relative paths for long stacks);
    `reserve` is what the other mount options take of the page."""
    limit = _MAX_OPTION - reserve
    lower = ":".join(str(p) for p in layers)
    if len(lower) <= limit:
        return lower, None
    # overlayfs resolves relative lowerdirs against the caller's cwd.
    cwd = os.path.commonpath([str(p) for p in layers])
    lower = ":".join(os.path.relpath(p, cwd) for p in layers)
    if len(lower) > limit:
        raise RuntimeFailure(f"layer stack too long for one overlay ({len(layers)})")
    return lower, cwd


# Options of every overlay aenv mounts on the host (see the module's docstring).
HOST_OPTIONS = "nosuid,nodev"
# Options of a writable sandbox overlay: no redirects, metacopy or index, so that the upper,
# once sealed, is an ordinary layer (full copies, whiteouts, opaque dirs) valid in any stack.
WRITABLE_OPTIONS = "redirect_dir=off,metacopy=off,index=off"


def _check_paths(paths: list[Path]) -> None:
    for p in paths:
        if ":" in str(p) or "," in str(p) or not p.is_absolute():
            raise RuntimeFailure(f"path not usable in an overlay: {p}")


async def _mount_overlay(name: str, opts: str, target: Path, cwd: str | None) -> None:
    """One overlay mount: mount(2) itself when the paths are absolute (the mount program is
    a process start, ~10 ms, on every boot and restore); the program, run from `cwd`, for a
    stack whose lowerdirs only fit the page as relative paths (a cwd is process-wide)."""
    if cwd is not None:
        await _proc.run(["mount", "-t", "overlay", name, "-o", opts, str(target)], cwd=cwd)
        return
    err = await asyncio.to_thread(_proc.mount, name, str(target), "overlay", opts)
    if err:
        raise RuntimeFailure(f"mount -t overlay {name} {target}: {os.strerror(err)}")


async def mount_writable(layers: list[Path], upper: Path, work: Path, target: Path) -> None:
    """Mounts `lowerdir=layers,upperdir=upper,workdir=work` at `target` (created).

    `work` is (re)created empty; it must be on the same filesystem as `upper`."""
    if not layers:
        raise RuntimeFailure("a sandbox needs at least one layer")
    _check_paths([*layers, upper, work])

    def prepare() -> None:
        if not upper.is_dir():
            raise RuntimeFailure(f"upper dir {upper} does not exist")
        if _is_mount_point(target):
            raise RuntimeFailure(f"{target} is already a mount point")
        if work.exists() or work.is_symlink():
            remove_work_dir(work)
        work.mkdir(mode=0o700)
        target.mkdir(parents=True, exist_ok=True)
        if os.stat(work).st_dev != os.stat(upper).st_dev:
            raise RuntimeFailure(f"work dir {work} is not on the filesystem of {upper}")

    await asyncio.to_thread(prepare)
    lower, cwd = _lowerdir(layers, reserve=len(str(upper)) + len(str(work)) + 80)
    opts = f"{HOST_OPTIONS},lowerdir={lower},upperdir={upper},workdir={work},{WRITABLE_OPTIONS}"
    try:
        await _mount_overlay("aenv-sbx", opts, target, cwd)
    except BaseException:
        await asyncio.to_thread(remove_work_dir, work)
        raise


async def unmount(target: Path) -> bool:
    """Unmounts `target` (lazily when busy); True when nothing is mounted there any more."""
    return await asyncio.to_thread(_unmount, str(target))


def ensure_tmp(root: Path) -> bool:
    """Makes sure a mounted writable rootfs has a /tmp directory (mode 1777 when made
    here); False when its /tmp is something else (a symlink: left to the image)."""
    tmp = root / "tmp"
    if tmp.is_symlink() or (tmp.exists() and not tmp.is_dir()):
        return False
    if not tmp.exists():
        tmp.mkdir()
        tmp.chmod(0o1777)
    return True


def _unmount(target: str) -> bool:
    # The syscall itself: the umount program costs a process start on every snapshot.
    if not _is_mount_point(Path(target)):
        return True
    err = _proc.umount(target)
    if err and _is_mount_point(Path(target)):
        log.warning("umount %s: %s; detaching lazily", target, os.strerror(err))
        _proc.umount(target, lazy=True)
    return not _is_mount_point(Path(target))


def remove_work_dir(work: Path) -> None:
    """Removes an overlay work dir (never a mount point, never through a symlink). Sync."""
    if work.is_symlink():
        work.unlink()
        return
    if not work.is_dir() or _is_mount_point(work) or mount_points(work):
        return
    # overlayfs leaves `work/work` (mode 000) behind; root removes it regardless.
    shutil.rmtree(work, ignore_errors=True)


class RootfsMounts:
    def __init__(self, mnt_dir: Path) -> None:
        self.mnt_dir = mnt_dir
        self._refs: dict[str, set[str]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def prepare(self) -> None:
        await asyncio.to_thread(self.mnt_dir.mkdir, parents=True, exist_ok=True)

    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def acquire(self, layers: list[Path], owner: str) -> tuple[Path, str | None]:
        """The rootfs path for `layers` and its stack key (None for a single layer)."""
        if not layers:
            raise RuntimeFailure("a sandbox needs at least one layer")
        if len(layers) == 1:
            return layers[0], None
        key = stack_key(layers)
        target = self.mnt_dir / key
        async with self._lock(key):
            refs = self._refs.setdefault(key, set())
            if not refs:
                await self._mount(layers, target)
            refs.add(owner)
        return target, key

    async def _mount(self, layers: list[Path], target: Path) -> None:
        for p in layers:
            if ":" in str(p) or "," in str(p):
                raise RuntimeFailure(f"layer path not usable in an overlay: {p}")
        await asyncio.to_thread(target.mkdir, parents=True, exist_ok=True)
        if await asyncio.to_thread(_is_mount_point, target):
            return  # left over from before a restart, same stack (same key): reuse
        lower, cwd = _lowerdir(layers)
        opts = f"ro,{HOST_OPTIONS},lowerdir={lower}"
        await _mount_overlay("aenv-rootfs", opts, target, cwd)

    def adopt(self, key: str, owner: str) -> None:
        """Records a reference held by a sandbox recovered after a restart."""
        self._refs.setdefault(key, set()).add(owner)

    async def release(self, key: str | None, owner: str) -> None:
        if key is None:
            return
        async with self._lock(key):
            refs = self._refs.get(key)
            if refs is None or owner not in refs:
                return
            refs.discard(owner)
            if refs:
                return
            del self._refs[key]
            await self._unmount(self.mnt_dir / key)

    async def _unmount(self, target: Path) -> None:
        await asyncio.to_thread(_unmount, str(target))
        with contextlib.suppress(OSError):
            await asyncio.to_thread(target.rmdir)

    async def cleanup(self, keep: set[str]) -> list[str]:
        """Unmounts every stack under the mount dir whose key is not in `keep`."""
        removed: list[str] = []
        if not self.mnt_dir.is_dir():
            return removed
        for mp in await asyncio.to_thread(mount_points, self.mnt_dir):
            if mp.parent == self.mnt_dir and mp.name in keep:
                continue
            await self._unmount(mp)
            removed.append(mp.name)
        # Empty directories of stacks that are no longer mounted.
        for entry in await asyncio.to_thread(lambda: list(self.mnt_dir.iterdir())):
            if entry.name not in keep and entry.is_dir():
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(entry.rmdir)
        return removed

    async def remove(self) -> None:
        """Unmounts every stack and removes the directory."""
        await self.cleanup(set())
        self._refs.clear()
        # rmdir only (never a recursive delete that could walk into a mount).
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self.mnt_dir.rmdir)
