"""The guest's block devices, as files on the host.

* **Images** (read-only, shared): a layer stack merged into one ext4 image (`mkfs.ext4 -d`
  from the stack's read-only host overlay), one per stack, cached under
  `$AENV_HOME/qemu/images/` and attached read-only to every sandbox of that stack; the same
  for each read-only directory a sandbox mounts (the envd bundle). Their names are keyed by
  the paths they came from: layers and bundles are content-addressed and never change.
* **Disks** (one per sandbox): a sparse copy of an empty ext4 file system (no journal: the
  host reads it after a guest `sync`, see `copy_upper_out`) that holds the guest overlay's
  upper and work dirs. A checkpoint image holds it packed (its written extents only, `pack`);
  a restored VM unpacks its own copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import shutil
import struct
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import BinaryIO

from aenv.errors import RuntimeFailure
from aenv.runtime import _proc
from aenv.runtime.rootfs import RootfsMounts, stack_key

MiB = 1024 * 1024
# The writable disk's size when the spec names none: sparse, so a bound, not a reservation.
DISK_MB = 4096
_MKFS = ["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "root_owner=0:0"]


def _tree_size(root: Path) -> tuple[int, int]:
    """(bytes, entries) under `root`, not following links."""
    size, count = 0, 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            count += 1
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                size += st.st_blocks * 512
    return size, count


async def _mkfs_from(tree: Path | None, target: Path, size_mb: int, inodes: int = 0) -> None:
    """An ext4 image of `size_mb` at `target` holding `tree` (empty: None), made beside it and
    renamed into place, so a half-made image is never seen."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    await asyncio.to_thread(tmp.unlink, missing_ok=True)
    argv = [*_MKFS]
    if inodes:
        argv += ["-N", str(inodes)]
    if tree is not None:
        argv += ["-d", str(tree)]
    try:
        await _proc.run([*argv, str(tmp), f"{size_mb}M"], time_limit=1800)
        await asyncio.to_thread(tmp.rename, target)
    finally:
        await asyncio.to_thread(tmp.unlink, missing_ok=True)


class Images:
    """Read-only ext4 images of layer stacks and mounted directories, made once each."""

    def __init__(self, cache: Path, mounts: RootfsMounts) -> None:
        self.cache = cache
        self.mounts = mounts
        self._locks: dict[str, asyncio.Lock] = {}

    async def prepare(self) -> None:
        await asyncio.to_thread(self.cache.mkdir, parents=True, exist_ok=True)

    async def _made(self, name: str, make: Callable[[Path], Awaitable[None]]) -> Path:
        target = self.cache / name
        async with self._locks.setdefault(name, asyncio.Lock()):
            if not await asyncio.to_thread(target.exists):
                await make(target)
        return target

    async def of_stack(self, layers: list[Path]) -> Path:
        """The merged image of `layers` (topmost first)."""
        if not layers:
            raise RuntimeFailure("a sandbox needs at least one layer")
        owner = f"image-{os.getpid()}"

        async def make(target: Path) -> None:
            root, key = await self.mounts.acquire(layers, owner)
            try:
                await self._image_of(root, target)
            finally:
                await self.mounts.release(key, owner)

        return await self._made(f"stack-{stack_key(layers)}.ext4", make)

    async def of_dir(self, source: Path) -> Path:
        if not await asyncio.to_thread(source.is_dir):
            raise RuntimeFailure(f"the qemu backend mounts directories only, not {source}")
        real = await asyncio.to_thread(source.resolve)
        key = hashlib.sha256(str(real).encode()).hexdigest()[:24]
        return await self._made(f"dir-{key}.ext4", lambda t: self._image_of(source, t))

    async def _image_of(self, root: Path, target: Path) -> None:
        size, count = await asyncio.to_thread(_tree_size, root)
        size_mb = 64 + int(size * 1.15) // MiB + count * 4096 // MiB
        await _mkfs_from(root, target, size_mb, inodes=count + 4096)

    async def empty_disk(self, size_mb: int) -> Path:
        """An empty file system of `size_mb` (one per size), sparse: its copies are cheap."""
        return await self._made(f"empty-{size_mb}.ext4", lambda t: _mkfs_from(None, t, size_mb))


# A disk in a checkpoint image holds only its written extents (`pack`): a 10 GiB disk with
# 50 MiB written is a 50 MiB file wherever the image goes (the repository, S3, a hash).
_SPARSE_MAGIC = b"AENV-SPARSE-1\n"
_EXTENT = struct.Struct("<QQ")
_CHUNK = 1 << 20


def pack(source: Path, target: Path) -> None:
    """`source`'s data extents (SEEK_DATA/SEEK_HOLE) as one file: magic, size, then
    (offset, length, bytes) per extent. Blocking."""
    with open(source, "rb") as src, open(target, "wb") as out:
        size = os.fstat(src.fileno()).st_size
        out.write(_SPARSE_MAGIC + struct.pack("<Q", size))
        at = 0
        while at < size:
            try:
                start = os.lseek(src.fileno(), at, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after `at`
                break
            end = os.lseek(src.fileno(), start, os.SEEK_HOLE)
            out.write(_EXTENT.pack(start, end - start))
            src.seek(start)
            _copy_bytes(src, out, end - start, f"{source} shrank while it was packed")
            at = end


def unpack(source: Path, target: Path) -> None:
    """The sparse file `pack` made `source` from. Blocking."""
    with open(source, "rb") as src, open(target, "wb") as out:
        if src.read(len(_SPARSE_MAGIC)) != _SPARSE_MAGIC:
            raise RuntimeFailure(f"{source} is not a packed disk")
        (size,) = struct.unpack("<Q", src.read(8))
        out.truncate(size)
        while head := src.read(_EXTENT.size):
            if len(head) != _EXTENT.size:
                raise RuntimeFailure(f"{source} is cut short")
            start, length = _EXTENT.unpack(head)
            out.seek(start)
            _copy_bytes(src, out, length, f"{source} is cut short")


def _copy_bytes(src: BinaryIO, out: BinaryIO, n: int, short: str) -> None:
    """`n` bytes from `src` to `out`; `RuntimeFailure(short)` when `src` ends first."""
    while n:
        chunk = src.read(min(_CHUNK, n))
        if not chunk:
            raise RuntimeFailure(short)
        out.write(chunk)
        n -= len(chunk)


async def copy_file(source: Path, target: Path) -> None:
    """A copy sharing blocks where the file system can, holes kept everywhere."""
    await _proc.run(
        ["cp", "--reflink=auto", "--sparse=always", str(source), str(target)], time_limit=600
    )


async def disk_from_upper(upper: Path, target: Path, size_mb: int) -> None:
    """A sandbox's disk that starts with the files of a non-empty host `upper` (a sandbox
    booted again after a stop): the tree is staged as `upper/` through a bind mount."""
    stage = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="aenv-qstage-"))
    try:
        await asyncio.to_thread((stage / "upper").mkdir)
        await asyncio.to_thread((stage / "work").mkdir)
        await _proc.run(["mount", "--bind", "-o", "ro", str(upper), str(stage / "upper")])
        try:
            await _mkfs_from(stage, target, size_mb)
        finally:
            await _proc.run(["umount", str(stage / "upper")], check=False)
    finally:
        with contextlib.suppress(OSError):
            await asyncio.to_thread(shutil.rmtree, stage)


async def copy_upper_out(disk: Path, upper: Path) -> None:
    """Makes the host dir `upper` hold what the guest overlay's upper on `disk` holds (after
    a guest `sync`, its vCPUs stopped or the guest gone): the file system is mounted read-only
    through a loop device and its `upper/` copied with modes, owners, xattrs (overlayfs's
    opaque marks) and whiteouts (0/0 character devices)."""
    # Copied beside it and swapped in whole: a copy that fails (the host's disk full, the
    # guest's disk unreadable) leaves the last good copy in place.
    stage = upper.with_name(f".{upper.name}.new-{secrets.token_hex(4)}")
    mnt = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="aenv-qdisk-"))
    try:
        await asyncio.to_thread(_dir_like, upper, stage)
        await _proc.run(["mount", "-o", "ro,loop,noexec,nosuid,nodev", str(disk), str(mnt)])
        try:
            if await asyncio.to_thread((mnt / "upper").is_dir):
                await _proc.run(
                    ["cp", "-a", "--reflink=auto", f"{mnt}/upper/.", f"{stage}/"], time_limit=1800
                )
        finally:
            await _proc.run(["umount", str(mnt)], check=False)
        await asyncio.to_thread(_swap, stage, upper)
    except OSError as e:
        raise RuntimeFailure(f"copying the files out of {disk}: {e}") from e
    finally:
        await asyncio.to_thread(shutil.rmtree, stage, True)
        with contextlib.suppress(OSError):
            await asyncio.to_thread(mnt.rmdir)


def _dir_like(model: Path, new: Path) -> None:
    new.mkdir()
    st = model.stat()
    os.chown(new, st.st_uid, st.st_gid)
    shutil.copystat(model, new)


def _swap(new: Path, target: Path) -> None:
    """`new` in place of the directory `target`, whose old contents go."""
    old = target.with_name(f".{target.name}.old-{secrets.token_hex(4)}")
    os.rename(target, old)
    try:
        os.rename(new, target)
    except OSError:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
