"""Artifacts: turning directories and large files into repository objects and back.

A **directory** (a sealed layer's rootfs) travels as one tar stream made by GNU tar in POSIX
(pax) format: modes, numeric uids/gids, mtimes, symlinks, hard links, device nodes (overlay
whiteouts are 0/0 character devices), sparse files, xattrs in every namespace (overlay's
``trusted.overlay.opaque`` included) and ACLs. The stream is optionally zstd-compressed and
hashed (sha256 of the stored bytes, i.e. after compression) while it is written to a file.

A **large single file** (a checkpoint's ``pages.img``) is stored as its own object, raw or
zstd-compressed, so restoring streams it without any tar in between.

Unpacking never leaves a partial result: it extracts into a temp directory beside the target
and renames it into place only when tar finished without error. Checksums are verified by
the caller *before* unpacking (`SnapshotStore` does; `Repository.get_file` verifies while it
downloads).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal, cast

import zstandard

from ..fsutil import rmtree
from .errors import ArtifactCorrupt, ArtifactError

Compression = Literal["none", "zstd"]
CHUNK = 4 * 1024 * 1024

# Packing runs in worker threads (asyncio.to_thread copies the caller's context): a publish
# that is cancelled sets its event, and the thread stops at the next chunk instead of
# hashing and compressing gigabytes nobody will read.
_cancel: ContextVar[threading.Event | None] = ContextVar("aenv_pack_cancel", default=None)


class PackCancelled(ArtifactError):
    """The publish this packing belonged to was cancelled."""


@contextlib.contextmanager
def cancellable() -> Iterator[threading.Event]:
    """Packing started in this context (threads included) stops once the event is set."""
    event = threading.Event()
    token = _cancel.set(event)
    try:
        yield event
    finally:
        _cancel.reset(token)


def _check_cancel() -> None:
    event = _cancel.get()
    if event is not None and event.is_set():
        raise PackCancelled("packing cancelled")


_FICLONE = 0x40049409  # ioctl(dst, FICLONE, src): reflink on btrfs/xfs/bcachefs


@dataclass(frozen=True)
class Packed:
    path: Path  # the file to upload
    sha256: str  # hex sha256 of the file's bytes (as stored)
    size: int  # stored bytes
    raw_size: int  # bytes before compression (tar stream or file size)
    compression: Compression


def suffix(compression: Compression) -> str:
    return ".zst" if compression == "zstd" else ""


class _HashingSink:
    """A binary file wrapper that hashes and counts what is written to it."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.h = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        self.h.update(data)
        self._f.write(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        self._f.flush()


def _tar_common() -> list[str]:
    return ["--numeric-owner", "--xattrs", "--xattrs-include=*", "--acls"]


def _tar_error(what: str, err: IO[bytes], rc: int | None) -> str:
    err.seek(0)
    text = err.read().decode("utf-8", "replace").strip()
    tail = "; ".join(text.splitlines()[-5:])
    return f"{what} failed (exit {rc}): {tail or 'no message'}"


def _compressor(level: int, threads: int) -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(level=level, threads=threads)


def pack_dir(
    src: Path,
    dest: Path,
    *,
    compression: Compression = "zstd",
    level: int = 3,
    threads: int = 0,
) -> Packed:
    """Writes the tree at src as a tar (``.zst``) to the new file dest; returns its checksum.

    dest is written in place (callers give a path in a staging directory); on error it is
    removed."""
    src = Path(src)
    if not src.is_dir() or src.is_symlink():
        raise ArtifactError(f"cannot pack {src}: not a directory")
    cmd = [
        "tar",
        "--create",
        "--file=-",
        f"--directory={src}",
        "--format=posix",
        "--pax-option=delete=atime,delete=ctime",
        "--sparse",
        *_tar_common(),
        ".",
    ]
    dest = Path(dest)
    try:
        with tempfile.TemporaryFile() as err, open(dest, "xb") as out:
            sink = _HashingSink(out)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
            assert proc.stdout is not None
            raw = 0
            try:
                if compression == "zstd":
                    with _compressor(level, threads).stream_writer(
                        cast(IO[bytes], sink), closefd=False, write_return_read=True
                    ) as zw:
                        while chunk := proc.stdout.read(CHUNK):
                            _check_cancel()
                            raw += len(chunk)
                            zw.write(chunk)
                else:
                    while chunk := proc.stdout.read(CHUNK):
                        _check_cancel()
                        raw += len(chunk)
                        sink.write(chunk)
            except PackCancelled:
                proc.kill()
                raise
            finally:
                proc.stdout.close()
                rc = proc.wait()
            if rc != 0:
                raise ArtifactError(_tar_error(f"packing {src}", err, rc))
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            dest.unlink()
        raise
    return Packed(dest, sink.h.hexdigest(), sink.size, raw, compression)


def unpack_dir(obj: Path, dest: Path, *, compression: Compression) -> None:
    """Extracts the tar object into the new directory dest, all or nothing: into a temp
    directory beside dest first, renamed to dest when tar succeeded."""
    dest = Path(dest)
    if dest.exists() or dest.is_symlink():
        raise ArtifactError(f"cannot unpack into {dest}: it exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.unpack-{uuid.uuid4().hex[:12]}")
    tmp.mkdir()
    cmd = ["tar", "--extract", "--file=-", f"--directory={tmp}", *_tar_common()]
    if os.geteuid() == 0:
        cmd += ["--same-owner", "--same-permissions"]
    try:
        with tempfile.TemporaryFile() as err, open(obj, "rb") as f:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stderr=err)
            assert proc.stdin is not None
            broken = False
            try:
                source: IO[bytes] = f
                if compression == "zstd":
                    source = zstandard.ZstdDecompressor().stream_reader(f, read_size=CHUNK)
                while chunk := source.read(CHUNK):
                    proc.stdin.write(chunk)
            except BrokenPipeError:
                broken = True
            except zstandard.ZstdError as e:
                proc.kill()
                raise ArtifactCorrupt(f"{obj.name}: not a valid zstd stream: {e}") from e
            finally:
                with contextlib.suppress(BrokenPipeError):
                    proc.stdin.close()
                rc = proc.wait()
            if rc != 0 or broken:
                raise ArtifactCorrupt(_tar_error(f"unpacking {obj.name}", err, rc))
        os.rename(tmp, dest)
    except BaseException:
        rmtree(tmp)
        raise


def hash_file(path: Path) -> tuple[str, int]:
    """(sha256 hex, size) of a file, read in chunks."""
    h = hashlib.sha256()
    size = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            _check_cancel()
            h.update(view[:n])
            size += n
    return h.hexdigest(), size


def pack_file(
    src: Path,
    dest: Path,
    *,
    compression: Compression,
    level: int = 3,
    threads: int = 0,
) -> Packed:
    """A single file as an object. "none": the object is src itself (dest is not written,
    only the checksum is computed); "zstd": src compressed into the new file dest."""
    src = Path(src)
    if compression == "none":
        digest, size = hash_file(src)
        return Packed(src, digest, size, size, "none")
    dest = Path(dest)
    raw = 0
    try:
        with open(src, "rb") as f, open(dest, "xb") as out:
            sink = _HashingSink(out)
            with _compressor(level, threads).stream_writer(
                cast(IO[bytes], sink),
                size=os.fstat(f.fileno()).st_size,
                closefd=False,
                write_return_read=True,
            ) as zw:
                while chunk := f.read(CHUNK):
                    _check_cancel()
                    raw += len(chunk)
                    zw.write(chunk)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            dest.unlink()
        raise
    return Packed(dest, sink.h.hexdigest(), sink.size, raw, "zstd")


def unpack_file(obj: Path, dest: Path, *, compression: Compression, mode: int = 0o644) -> None:
    """Turns a downloaded object into the file dest (temp + rename). "none" renames obj."""
    dest = Path(dest)
    if compression == "none":
        os.chmod(obj, mode)
        os.replace(obj, dest)
        return
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:12]}.part")
    try:
        with open(obj, "rb") as f, open(tmp, "xb") as out:
            try:
                zstandard.ZstdDecompressor().copy_stream(f, out, read_size=CHUNK, write_size=CHUNK)
            except zstandard.ZstdError as e:
                raise ArtifactCorrupt(f"{obj.name}: not a valid zstd stream: {e}") from e
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def clone_file(src: Path, dst: Path, *, allow_hardlink: bool) -> str:
    """Makes dst a copy of src as cheaply as the filesystem allows; returns how:
    "reflink" (copy-on-write clone, always safe), "hardlink" (same inode: only when
    allow_hardlink, i.e. neither side is ever written to) or "copy"."""
    src, dst = Path(src), Path(dst)
    with open(src, "rb") as fs, open(dst, "xb") as fd:
        try:
            fcntl.ioctl(fd.fileno(), _FICLONE, fs.fileno())
        except OSError:
            pass
        else:
            shutil.copymode(src, dst)
            return "reflink"
    if allow_hardlink:
        try:
            dst.unlink()
            os.link(src, dst)
            return "hardlink"
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES):
                raise
    dst.unlink(missing_ok=True)
    shutil.copyfile(src, dst)
    shutil.copymode(src, dst)
    return "copy"
