"""Per-sandbox disks: the writable layer's size limit.

A sandbox's uppers (`rw/<sandbox_id>/`) live on a filesystem of their own: a sparse ext4
image `disks/<sandbox_id>.ext4` of the sandbox's disk size, loop-mounted (nosuid, nodev)
on `rw/<sandbox_id>`. A write past the size fails inside the sandbox with ENOSPC, the files
API answers 507, and nothing else on the node fills up. The image takes only what was
written (a few MiB when fresh), so the size is a limit, not a reservation.

Formatting costs ~30 ms, so a few formatted spares wait under `disks/` (`spare-*.ext4`);
attaching one is a rename and a mount. Sealing an upper into the layer store crosses
filesystems and so copies it (`LayerStore.add_dir` falls back to a copy on EXDEV)."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import subprocess
import threading
from pathlib import Path
from typing import Protocol

from aenv.errors import RuntimeFailure
from aenv.runtime.rootfs import is_mount_point

log = logging.getLogger("aenv.runtime")

SUFFIX = ".ext4"
_SPARE = "spare-"
_MOUNT_OPTIONS = "loop,nosuid,nodev,noatime"
# No root-reserved blocks (the sandbox is the only user); inode tables and the journal
# initialised lazily, so formatting writes only a few MiB whatever the size.
_MKFS = [
    "mkfs.ext4",
    "-q",
    "-F",
    "-m",
    "0",
    "-E",
    "lazy_itable_init=1,lazy_journal_init=1,nodiscard",
]


class SandboxDisks(Protocol):
    """Where a sandbox's uppers live with its size limit: an ext4 image each (`Disks`) or a
    subvolume each of the node's btrfs pool (`cowpool.CowPool`)."""

    def mount_point(self, sandbox_id: str) -> Path: ...

    def attach(self, sandbox_id: str, size_mb: int) -> Path: ...

    def detach(self, sandbox_id: str) -> None: ...

    def remount(self, sandbox_id: str, size_mb: int) -> None: ...

    def owners(self) -> set[str]: ...

    def refill(self, size_mb: int) -> None: ...

    def usage(self, sandbox_id: str, size_mb: int) -> tuple[int, int]: ...


class Disks:
    def __init__(self, images_dir: Path, mounts_dir: Path, *, spares: int = 2) -> None:
        self.images_dir = images_dir
        self.mounts_dir = mounts_dir
        self.spares = spares
        self._lock = threading.Lock()
        self._refilling = threading.Lock()
        images_dir.mkdir(parents=True, exist_ok=True)

    def image(self, sandbox_id: str) -> Path:
        return self.images_dir / f"{sandbox_id}{SUFFIX}"

    def mount_point(self, sandbox_id: str) -> Path:
        return self.mounts_dir / sandbox_id

    def attach(self, sandbox_id: str, size_mb: int) -> Path:
        """Mounts the sandbox's disk (made first if it has none; an existing one keeps its
        files, e.g. after the host rebooted) and returns where. Idempotent."""
        target = self.mount_point(sandbox_id)
        if is_mount_point(target):
            return target
        image = self.image(sandbox_id)
        if not image.exists():
            self._take_spare(image, size_mb) or self._format(image, size_mb)
        target.mkdir(parents=True, exist_ok=True)
        run_tool(["mount", "-o", _MOUNT_OPTIONS, str(image), str(target)], f"mounting {image}")
        # Only root (the gofer) walks the sandbox's files on the host.
        target.chmod(0o700)
        with contextlib.suppress(FileNotFoundError):
            (target / "lost+found").rmdir()
        return target

    def detach(self, sandbox_id: str) -> None:
        """Unmounts and deletes the sandbox's disk (its files go with it)."""
        target = self.mount_point(sandbox_id)
        if is_mount_point(target):
            # Lazy: a process still holding a file there (a slow runsc delete) must not
            # keep the disk; the kernel frees it when the last one lets go.
            subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)
        with contextlib.suppress(FileNotFoundError):
            self.image(sandbox_id).unlink()

    def remount(self, sandbox_id: str, size_mb: int) -> None:
        """Mounts the sandbox's disk again if it has one (after a host reboot)."""
        if self.image(sandbox_id).exists():
            self.attach(sandbox_id, size_mb)

    def usage(self, sandbox_id: str, size_mb: int) -> tuple[int, int]:
        """(used, total) bytes of the sandbox's disk, as its filesystem counts them."""
        total = size_mb * 1024 * 1024
        target = self.mount_point(sandbox_id)
        if not is_mount_point(target):
            return 0, total
        try:
            sv = os.statvfs(target)
        except OSError:
            return 0, total
        return (sv.f_blocks - sv.f_bfree) * sv.f_frsize, sv.f_blocks * sv.f_frsize

    def owners(self) -> set[str]:
        """The sandbox ids that have a disk image here (spares excluded)."""
        return {
            p.name[: -len(SUFFIX)]
            for p in self.images_dir.glob(f"*{SUFFIX}")
            if not p.name.startswith(_SPARE)
        }

    def refill(self, size_mb: int) -> None:
        """Formats spares of `size_mb` up to the wanted count (blocking; run it off the
        event loop). Spares of another size are dropped. One refill at a time: a second
        caller returns at once."""
        if not self._refilling.acquire(blocking=False):
            return
        try:
            self._refill(size_mb)
        finally:
            self._refilling.release()

    def _refill(self, size_mb: int) -> None:
        for p in self.images_dir.glob(f"{_SPARE}*{SUFFIX}"):
            if _size_mb(p) != size_mb:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        while len(list(self.images_dir.glob(f"{_SPARE}*{SUFFIX}"))) < self.spares:
            stage = self.images_dir / f".{_SPARE}{secrets.token_hex(6)}{SUFFIX}"
            self._format(stage, size_mb)
            os.rename(stage, self.images_dir / stage.name[1:])

    def _take_spare(self, image: Path, size_mb: int) -> bool:
        with self._lock:
            for p in sorted(self.images_dir.glob(f"{_SPARE}*{SUFFIX}")):
                if _size_mb(p) != size_mb:
                    continue
                try:
                    os.rename(p, image)
                except FileNotFoundError:
                    continue
                return True
        return False

    def _format(self, image: Path, size_mb: int) -> bool:
        try:
            with open(image, "wb") as f:
                f.truncate(size_mb * 2**20)
            run_tool([*_MKFS, str(image)], f"formatting {image}")
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                image.unlink()
            raise
        return True


def _size_mb(image: Path) -> int:
    try:
        return image.stat().st_size // 2**20
    except FileNotFoundError:
        return -1


def run_tool(args: list[str], what: str) -> None:
    p = subprocess.run(args, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeFailure(f"{what}: {(p.stderr or p.stdout).strip() or p.returncode}")
