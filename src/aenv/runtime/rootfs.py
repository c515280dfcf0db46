"""Read-only root filesystems for sandboxes (decision 2, first version).

One layer: the layer directory itself is the rootfs. Several layers: one read-only host overlay
(`lowerdir=l1:l2:...`, no upper) per distinct layer stack, mounted under `$AENV_HOME/mnt/<key>`
and shared by refcount. Sandbox writes never reach these: runsc runs with
`--overlay2=root:memory`, so they land in the sentry's memory overlay (and in checkpoints).

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
        return any(line.split()[4] == target for line in f)


def _lowerdir(layers: list[Path]) -> tuple[str, str | None]:
    """The `lowerdir=` value and the cwd to mount from (relative paths for long stacks)."""
    lower = ":".join(str(p) for p in layers)
    if len(lower) <= _MAX_OPTION:
        return lower, None
    # overlayfs resolves relative lowerdirs against the caller's cwd.
    cwd = os.path.commonpath([str(p) for p in layers])
    lower = ":".join(os.path.relpath(p, cwd) for p in layers)
    if len(lower) > _MAX_OPTION:
        raise RuntimeFailure(f"layer stack too long for one overlay ({len(layers)})")
    return lower, cwd


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
        await _proc.run(
            ["mount", "-t", "overlay", "aenv-rootfs", "-o", f"ro,lowerdir={lower}", str(target)],
            cwd=cwd,
        )

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
        res = await _proc.run(["umount", str(target)], check=False)
        if res.returncode != 0 and await asyncio.to_thread(_is_mount_point, target):
            log.warning("umount %s: %s; detaching lazily", target, res.stderr.strip())
            await _proc.run(["umount", "-l", str(target)], check=False)
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
