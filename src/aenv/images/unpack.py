"""Streaming, one-pass unpacking of OCI layer blobs into layer-store directories.

A layer blob flows through one chain, read once, in one worker thread::

    bytes (HTTP stream, after a replayed partial download) ─► blob digest, size cap,
      copy into the partial file ─► gzip (zlib) | zstd (zstandard) | plain ─► diff_id ─►
      tarfile stream mode ─► files under `dest`

The readers are in `streams`, the hand-off from the event loop in `pipe`; this module
extracts the tar and runs the whole chain (`unpack_layer`).

Each layer is stored separately and stacked later with overlayfs (`lowerdir=`), so the OCI
whiteouts become overlayfs ones: `.wh.<name>` becomes a 0/0 character device `<name>` and
`.wh..wh..opq` the `trusted.overlay.opaque=y` xattr on its directory. That device is the only
one written; other device nodes are skipped with a warning (/dev comes from the runtime).

Safety: absolute member names and `..` components refuse the layer; a path component that is
a symlink is resolved *inside* the layer (as if the layer were `/`), so no write ever lands
outside `dest`; the last component of a path is never followed (an existing entry is
replaced). Ownership (numeric uid/gid), modes (setuid/setgid/sticky included), mtimes,
hard links within the layer, symlinks, FIFOs and the `user.*` / `security.capability`
xattrs are kept; `trusted.*` and other xattrs from the archive are dropped (a layer must not
forge overlayfs metadata). Unpacking needs root (chown, mknod, trusted xattrs).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from ..fsutil import rmtree
from .manifests import DigestMismatch, digest_algo
from .streams import (
    CHUNK,
    BlobSource,
    Compression,
    GzipReader,
    HashReader,
    InvalidLayer,
    Reader,
    ZstdReader,
    detect_compression,
)

log = logging.getLogger("aenv.images")

OPAQUE_XATTR = "trusted.overlay.opaque"
WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
_MAX_SYMLINK_HOPS = 40
_KEPT_XATTRS = ("user.", "security.capability")
# What the archive's own content provokes (a 300-byte name, a link loop, too many links to
# one file); any other OSError (ENOSPC, EIO, EPERM) is the node's and stays one.
_CONTENT_ERRNOS = frozenset(
    {
        errno.ENAMETOOLONG,
        errno.ENOENT,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EEXIST,
        errno.ELOOP,
        errno.EINVAL,
        errno.EMLINK,
        errno.ENOTEMPTY,
    }
)


@dataclass
class UnpackStats:
    entries: int = 0
    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    whiteouts: int = 0
    opaque_dirs: int = 0
    skipped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class UnpackResult:
    digest: str  # of the blob as stored in the registry (compressed)
    diff_id: str  # of the uncompressed tar
    compressed_size: int
    tar_size: int
    compression: Compression
    stats: UnpackStats


def _split(name: str) -> list[str]:
    if name.startswith("/"):
        raise InvalidLayer(f"layer contains an absolute path: {name!r}")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidLayer(f"layer contains a path that escapes it: {name!r}")
    return parts


def _is_whiteout_dev(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _resolve_dir(root: str, parts: list[str], *, create: bool) -> str:
    """The host path of directory `parts` inside the layer `root`, following symlinks
    inside the layer as if `root` were `/` (`..` stops at root), creating missing ones."""
    stack: list[str] = []
    todo = list(parts)
    hops = 0
    while todo:
        comp = todo.pop(0)
        if comp in ("", "."):
            continue
        if comp == "..":
            if stack:
                stack.pop()
            continue
        cur = os.path.join(root, *stack, comp)
        st = _lstat(cur)
        if st is None:
            if not create:
                raise InvalidLayer(f"{'/'.join(parts)} does not exist in the layer")
            os.mkdir(cur, 0o755)
            stack.append(comp)
        elif stat.S_ISDIR(st.st_mode):
            stack.append(comp)
        elif stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > _MAX_SYMLINK_HOPS:
                raise InvalidLayer(f"too many levels of symbolic links in {'/'.join(parts)}")
            target = os.readlink(cur)
            if target.startswith("/"):
                stack = []
            todo = target.split("/") + todo
        elif create and _is_whiteout_dev(st):
            os.unlink(cur)
            os.mkdir(cur, 0o755)
            stack.append(comp)
        else:
            raise InvalidLayer(f"{'/'.join(parts)}: {comp} is not a directory")
    return os.path.join(root, *stack) if stack else root


def _remove(path: str, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode):
        rmtree(path)
    else:
        os.unlink(path)


def _xattrs(member: tarfile.TarInfo) -> list[tuple[str, bytes]]:
    out = []
    for key, value in member.pax_headers.items():
        if not key.startswith("SCHILY.xattr."):
            continue
        name = key[len("SCHILY.xattr.") :]
        if name.startswith(_KEPT_XATTRS):
            out.append((name, value.encode("utf-8", "surrogateescape")))
    return out


def _apply_meta(path: str, member: tarfile.TarInfo, *, symlink: bool = False) -> None:
    os.lchown(path, member.uid, member.gid)
    if not symlink:
        os.chmod(path, member.mode & 0o7777)
        for name, value in _xattrs(member):
            try:
                os.setxattr(path, name, value, follow_symlinks=False)
            except OSError as e:
                log.warning("cannot set xattr %s on %s: %s", name, member.name, e)


def _set_mtime(path: str, mtime: float) -> None:
    with contextlib.suppress(OSError):
        os.utime(path, (mtime, mtime), follow_symlinks=False)


def extract_tar(fileobj: Reader, dest: Path) -> UnpackStats:
    """Extracts an uncompressed layer tar stream (read once, in order) into `dest`."""
    root = str(dest)
    os.makedirs(root, exist_ok=True)
    stats = UnpackStats()
    dir_mtimes: dict[str, float] = {}
    try:
        with tarfile.open(fileobj=fileobj, mode="r|", bufsize=CHUNK) as tf:  # type: ignore[call-overload]
            for member in tf:
                stats.entries += 1
                try:
                    _extract_member(tf, member, root, stats, dir_mtimes)
                except OSError as e:
                    if e.errno not in _CONTENT_ERRNOS:
                        raise
                    raise InvalidLayer(f"layer entry {member.name!r}: {e.strerror}") from None
    except tarfile.TarError as e:
        raise InvalidLayer(f"layer is not a valid tar archive: {e}") from None
    # Directory mtimes last: creating their entries changed them.
    for path in sorted(dir_mtimes, key=len, reverse=True):
        _set_mtime(path, dir_mtimes[path])
    return stats


def _extract_member(
    tf: tarfile.TarFile,
    member: tarfile.TarInfo,
    root: str,
    stats: UnpackStats,
    dir_mtimes: dict[str, float],
) -> None:
    parts = _split(member.name)
    if not parts:  # the layer's root directory itself
        if member.isdir():
            _apply_meta(root, member)
            dir_mtimes[root] = member.mtime
        return
    base = parts[-1]
    parent = _resolve_dir(root, parts[:-1], create=True)

    if base.startswith(WHITEOUT_PREFIX):
        if base == OPAQUE_MARKER:
            os.setxattr(parent, OPAQUE_XATTR, b"y", follow_symlinks=False)
            stats.opaque_dirs += 1
        elif base.startswith(WHITEOUT_PREFIX + WHITEOUT_PREFIX):
            pass  # aufs metadata (.wh..wh.plnk, ...): meaningless here
        else:
            victim = base[len(WHITEOUT_PREFIX) :]
            if victim in ("", ".", ".."):
                raise InvalidLayer(f"invalid whiteout {member.name!r}")
            target = os.path.join(parent, victim)
            # Whiteouts hide lower layers only: an entry of this layer stays.
            if _lstat(target) is None:
                os.mknod(target, stat.S_IFCHR, os.makedev(0, 0))
                stats.whiteouts += 1
        return

    target = os.path.join(parent, base)
    existing = _lstat(target)

    if member.isdir():
        if existing is not None and not stat.S_ISDIR(existing.st_mode):
            _remove(target, existing)
            existing = None
        if existing is None:
            os.mkdir(target, 0o700)
        _apply_meta(target, member)
        dir_mtimes[target] = member.mtime
        stats.dirs += 1
        return

    if member.islnk():
        lparts = _split(member.linkname)
        if not lparts:
            raise InvalidLayer(f"hard link {member.name!r} to the layer root")
        src_dir = _resolve_dir(root, lparts[:-1], create=False)
        src = os.path.join(src_dir, lparts[-1])
        sst = _lstat(src)
        if sst is None:
            raise InvalidLayer(
                f"hard link {member.name!r} points to {member.linkname!r}, which is not in the layer"
            )
        if stat.S_ISDIR(sst.st_mode) or stat.S_ISCHR(sst.st_mode) or stat.S_ISBLK(sst.st_mode):
            raise InvalidLayer(f"hard link {member.name!r} to a directory or device")
        if existing is not None:
            if os.path.samestat(existing, sst):
                return
            _remove(target, existing)
        os.link(src, target, follow_symlinks=False)
        stats.hardlinks += 1
        return

    if member.ischr() or member.isblk():
        log.warning("layer: skipping device node %s", member.name)
        stats.skipped.append(member.name)
        return
    if not (member.isreg() or member.issym() or member.isfifo()):
        log.warning("layer: skipping %s of unsupported type %r", member.name, member.type)
        stats.skipped.append(member.name)
        return

    if member.issym() and not member.linkname:
        raise InvalidLayer(f"symbolic link {member.name!r} has an empty target")
    if existing is not None:
        _remove(target, existing)

    if member.issym():
        os.symlink(member.linkname, target)
        _apply_meta(target, member, symlink=True)
        _set_mtime(target, member.mtime)
        stats.symlinks += 1
        return
    if member.isfifo():
        os.mkfifo(target, 0o600)
        _apply_meta(target, member)
        _set_mtime(target, member.mtime)
        stats.files += 1
        return

    data = tf.extractfile(member)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if data is not None:
            while chunk := data.read(CHUNK):
                _write_all(fd, chunk)
        os.fchown(fd, member.uid, member.gid)
        os.fchmod(fd, member.mode & 0o7777)
        for name, value in _xattrs(member):
            try:
                os.setxattr(fd, name, value)
            except OSError as e:
                log.warning("cannot set xattr %s on %s: %s", name, member.name, e)
        os.utime(fd, (member.mtime, member.mtime))
    finally:
        os.close(fd)
    stats.files += 1


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


# --- the whole chain ---
def unpack_layer(
    live: Reader,
    dest: Path,
    *,
    media_type: str | None = None,
    digest: str | None = None,
    size: int | None = None,
    diff_id: str | None = None,
    replay: Reader | None = None,
    tee: BinaryIO | None = None,
) -> UnpackResult:
    """Decompresses and extracts a layer blob in one pass, verifying it.

    `live` yields the blob's bytes (after the `replay`ed ones, e.g. a partial download); live
    bytes are also written to `tee`. `digest` and `size` (from the manifest) and `diff_id`
    (from the image config) are checked once the stream ends: a mismatch raises
    `DigestMismatch` and `dest` must then be discarded by the caller."""
    algo = digest_algo(digest) if digest else "sha256"
    src = BlobSource(live, algo=algo, limit=size, replay=replay, tee=tee)
    compression = detect_compression(src.peek(4), media_type)
    dec: Reader
    if compression == "gzip":
        dec = GzipReader(src)
    elif compression == "zstd":
        dec = ZstdReader(src)
    else:
        dec = src
    tar_in = HashReader(dec)
    try:
        stats = extract_tar(tar_in, dest)
        tar_in.drain()
        src.drain()
    except (InvalidLayer, OSError) as e:
        # Tampered or truncated content usually breaks the tar first: say so if it is that.
        try:
            src.drain()
        except Exception:
            raise e from None
        got = src.digest()
        if digest and got != digest:
            raise DigestMismatch(
                f"content hashes to {got}, not {digest}", error_code="digest_mismatch"
            ) from e
        raise
    got = src.digest()
    if digest and got != digest:
        raise DigestMismatch(f"content hashes to {got}, not {digest}", error_code="digest_mismatch")
    if size is not None and src.count != size:
        raise DigestMismatch(
            f"{src.count} bytes received, the manifest states {size}", error_code="digest_mismatch"
        )
    got_diff = tar_in.digest()
    if diff_id and got_diff != diff_id:
        raise DigestMismatch(
            f"uncompressed content hashes to {got_diff}, but the image config lists diff_id "
            f"{diff_id}",
            error_code="diff_id_mismatch",
        )
    return UnpackResult(
        digest=got,
        diff_id=got_diff,
        compressed_size=src.count,
        tar_size=tar_in.count,
        compression=compression,
        stats=stats,
    )
