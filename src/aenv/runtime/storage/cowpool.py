"""The node's copy-on-write pool: layers and sandbox uppers on one btrfs filesystem.

A snapshot copies a running sandbox's upper into the layer store. On ext4 that copy moves
every byte written; on one btrfs filesystem a copy is a reflink (shared extents, metadata
only), so a snapshot of a sandbox that wrote a GiB costs what one that wrote nothing does.

Layout: a sparse file `$AENV_HOME/store.btrfs` (the size of the host filesystem under it, a
bound, not a reservation) holds two subvolumes, mounted on the usual `layers/` and `rw/`, so
no path changes and reflinks cross between them (one filesystem, two mounts). Each sandbox's
`rw/<sandbox_id>` is a subvolume of its own whose qgroup carries its disk size: a write past
it fails inside the sandbox with EDQUOT ("Disk quota exceeded"), the files API answers 507,
nothing else on the node fills up. Unlike the ext4 disks (`disks.py`), `df` in the sandbox
shows the pool's size, since overlayfs reports its upper's filesystem.

Chosen once, at the first start of a home (`open_pool`): `storage=auto` takes btrfs when the
tools and the kernel have it and the home holds no layers yet; a home made with ext4 disks
keeps them. Once made, the pool is what the home uses: mounted again on every start."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from aenv.config import Settings
from aenv.errors import RuntimeFailure
from aenv.runtime.rootfs import is_mount_point
from aenv.runtime.storage.disks import run_tool

log = logging.getLogger("aenv.runtime")

IMAGE = "store.btrfs"
_SUBVOLUMES = ("layers", "rw")
# commit=5: quotas (the usage metrics read) are counted per transaction, 30 s apart by default.
# discard=async: space freed in the pool is punched out of its sparse file (through the loop
# device), so the host gets back what killed sandboxes wrote instead of the file only growing.
_MOUNT_OPTIONS = "noatime,nodev,commit=5,discard=async"
TRIM_AFTER = 30.0
_FITRIM = 0xC0185879  # _IOWR('X', 121, struct fstrim_range)
# Sandboxes' metric samples ask for their usage every few seconds: one `qgroup show` answers
# for all of them, for this long.
_USAGE_TTL = 2.0


class CowPool:
    """The btrfs pool of one home: made, mounted, and its per-sandbox subvolumes."""

    def __init__(self, settings: Settings) -> None:
        self.limits = settings.disk_limits
        self.image = settings.home / IMAGE
        self.layers_dir = settings.layers_dir
        self.rw_dir = settings.rw_dir
        self._lock = threading.Lock()
        self._usage: dict[str, int] = {}
        self._usage_at = 0.0
        self._trim: threading.Timer | None = None

    # The filesystem.

    def create(self) -> None:
        """A new pool: formatted, quotas on, its two subvolumes made (not mounted)."""
        size = _host_size(self.image.parent)
        stage = self.image.with_name(f".{IMAGE}.new")
        try:
            with open(stage, "wb") as f:
                f.truncate(size)
            run_tool(["mkfs.btrfs", "-q", "-f", str(stage)], "formatting the storage pool")
            with tempfile.TemporaryDirectory(dir=self.image.parent) as top:
                run_tool(
                    ["mount", "-o", f"loop,{_MOUNT_OPTIONS}", str(stage), top], "mounting the pool"
                )
                try:
                    run_tool(["btrfs", "quota", "enable", top], "enabling quotas")
                    for name in _SUBVOLUMES:
                        run_tool(["btrfs", "subvolume", "create", f"{top}/{name}"], "a subvolume")
                        os.chmod(f"{top}/{name}", 0o700)
                finally:
                    subprocess.run(["umount", top], capture_output=True, check=False)
            os.rename(stage, self.image)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                stage.unlink()
            raise

    def mount(self) -> None:
        """Mounts the pool's subvolumes on layers/ and rw/ (those not mounted yet)."""
        for name, target in zip(_SUBVOLUMES, (self.layers_dir, self.rw_dir), strict=True):
            if is_mount_point(target):
                continue
            target.mkdir(parents=True, exist_ok=True)
            # mount(8) sets up one loop device for the file and reuses it for the second.
            opts = f"loop,{_MOUNT_OPTIONS},subvol={name}"
            run_tool(["mount", "-o", opts, str(self.image), str(target)], f"mounting {target}")

    def unmount(self) -> None:
        with self._lock:
            if self._trim is not None:
                self._trim.cancel()
                self._trim = None
        for target in (self.rw_dir, self.layers_dir):
            if is_mount_point(target):
                subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)

    # Sandboxes' subvolumes (the `SandboxDisks` of `disks.py`).

    def mount_point(self, sandbox_id: str) -> Path:
        return self.rw_dir / sandbox_id

    def attach(self, sandbox_id: str, size_mb: int) -> Path:
        """The sandbox's subvolume (made if new, with its size as limit). Idempotent."""
        target = self.mount_point(sandbox_id)
        if target.exists():
            return target
        stage = self.rw_dir / f".new-{sandbox_id}"
        if stage.exists():
            run_tool(["btrfs", "subvolume", "delete", str(stage)], "removing a half-made disk")
        run_tool(["btrfs", "subvolume", "create", str(stage)], f"making the disk of {sandbox_id}")
        if self.limits:
            run_tool(["btrfs", "qgroup", "limit", f"{size_mb}M", str(stage)], "setting its size")
        stage.chmod(0o700)
        os.rename(stage, target)
        return target

    def detach(self, sandbox_id: str) -> None:
        """Deletes the sandbox's subvolume with its files (the kernel frees it later)."""
        target = self.mount_point(sandbox_id)
        if not target.exists():
            return
        r = subprocess.run(
            ["btrfs", "subvolume", "delete", str(target)], capture_output=True, text=True
        )
        if r.returncode != 0:  # a plain directory (an upper left by an older layout)
            shutil.rmtree(target, ignore_errors=True)
        self._trim_soon()

    def _trim_soon(self) -> None:
        """The pool file is sparse, and what a deleted subvolume held stays allocated in it
        (online discard misses most of it): TRIM_AFTER seconds after a deletion (the kernel
        has freed it by then), the free space is trimmed, which punches it out of the file
        through the loop device. One pending trim at a time; none while nothing is deleted."""
        with self._lock:
            if self._trim is not None:
                return
            self._trim = threading.Timer(TRIM_AFTER, self._trim_now)
            self._trim.daemon = True
            self._trim.start()

    def _trim_now(self) -> None:
        with self._lock:
            self._trim = None
        if not is_mount_point(self.rw_dir):
            return  # unmounted meanwhile: never trim the host's own file system
        try:
            fd = os.open(self.rw_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.ioctl(fd, _FITRIM, struct.pack("QQQ", 0, 2**64 - 1, 0))
            finally:
                os.close(fd)
        except OSError as e:
            log.debug("trimming the pool: %s", e)

    def remount(self, sandbox_id: str, size_mb: int) -> None:
        """Nothing: a subvolume is there as long as the pool is mounted."""

    def owners(self) -> set[str]:
        if not self.rw_dir.is_dir():
            return set()
        return {p.name for p in self.rw_dir.iterdir() if not p.name.startswith(".")}

    def refill(self, size_mb: int) -> None:
        """Nothing waits formatted: a subvolume is made in a few milliseconds."""

    def usage(self, sandbox_id: str, size_mb: int) -> tuple[int, int]:
        """(used, total) bytes: what the sandbox's subvolume refers to, as of the pool's last
        commit (btrfs accounts quotas per transaction), against its size."""
        with self._lock:
            if time.monotonic() - self._usage_at > _USAGE_TTL:
                self._usage = self._read_usage()
                self._usage_at = time.monotonic()
            return self._usage.get(sandbox_id, 0), size_mb * 1024 * 1024

    def _read_usage(self) -> dict[str, int]:
        r = subprocess.run(
            ["btrfs", "qgroup", "show", "-re", "--raw", str(self.rw_dir)],
            capture_output=True,
            text=True,
            check=False,
        )
        used: dict[str, int] = {}
        for line in r.stdout.splitlines():
            parts = line.split()
            # qgroupid referenced exclusive max_rfer max_excl path ("rw/<sandbox_id>")
            if len(parts) >= 6 and parts[0].startswith("0/") and parts[1].isdigit():
                used[Path(parts[-1]).name] = int(parts[1])
        return used


def open_pool(settings: Settings) -> CowPool | None:
    """The home's pool, mounted; None when the home keeps its uppers on ext4 disks or plain
    directories (chosen by `settings.storage` at its first start, see the module's doc)."""
    pool = CowPool(settings)
    if pool.image.exists():
        pool.mount()
        return pool
    if settings.storage == "ext4" or _holds_state(settings):
        return None
    missing = [t for t in ("mkfs.btrfs", "btrfs") if shutil.which(t) is None]
    if missing:
        _unavailable(settings, f"{missing[0]} is not installed (btrfs-progs)")
        return None
    try:
        pool.create()
        pool.mount()
    except RuntimeFailure as e:
        pool.unmount()
        with contextlib.suppress(FileNotFoundError):
            pool.image.unlink()
        _unavailable(settings, str(e))
        return None
    log.info("storage: btrfs pool %s (reflink snapshots)", pool.image)
    return pool


def _unavailable(settings: Settings, why: str) -> None:
    if settings.storage == "btrfs":
        raise RuntimeFailure(f"AENV_STORAGE=btrfs: {why}")
    log.warning("storage: no btrfs pool (%s); uppers on ext4 disks", why)
    return None


def _holds_state(settings: Settings) -> bool:
    """Whether layers or uppers exist already on the home's own filesystem (an older home):
    a pool mounted over them would hide them."""
    for d in (settings.layers_dir, settings.rw_dir):
        if d.is_dir() and not is_mount_point(d) and any(d.iterdir()):
            return True
    return False


def _host_size(where: Path) -> int:
    where.mkdir(parents=True, exist_ok=True)
    sv = os.statvfs(where)
    return max(sv.f_blocks * sv.f_frsize, 1 << 30)
