"""Small file-system primitives shared by the stores: locks, durability, removal, and the
modes that keep the node's state to root.

Everything under $AENV_HOME is root's: catalogs holding envd tokens, key files, and the trees
a sandbox writes (layers, uppers), where it can plant a set-uid root binary or a device node.
The home and its state directories are 0700 and the secret/state files 0600, tightened on
every start for homes made before (`private_tree`), so no other host user reaches any of it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
# What SQLite keeps beside a database (the WAL holds recent rows, tokens included).
_SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")


@contextlib.contextmanager
def flock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created if missing), held for the block: serialises
    processes that fill one machine-wide cache entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def fsync_file(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path | str) -> None:
    """Makes the renames and creations in directory `path` durable. Best effort: some file
    systems refuse to fsync a directory, and a lost rename is then recovered like a crash."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_private(path: Path, data: bytes) -> None:
    """Replaces `path` atomically with `data`, readable by its owner only: readers see the
    old content or the new, never a part (a temp file beside it, fsynced, renamed over)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), PRIVATE_FILE)  # whatever the umask
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


# ioctl(FICLONE): the destination shares the source's extents (btrfs, XFS); EXDEV, EINVAL or
# EOPNOTSUPP elsewhere.
_FICLONE = 0x40049409


def clone_file(src: Path, dst: Path) -> None:
    """Copies a regular file's content into a new file `dst`: a reflink where the
    filesystem shares extents (no data moves), else a plain copy."""
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
            return
        except OSError:
            pass
        shutil.copyfileobj(fin, fout, 1 << 20)


def rmtree(path: Path | str) -> None:
    """rm -rf that tolerates what is already gone and read-only directories (a layer may
    hold a 0o555 directory; root can still empty it once its mode allows writes)."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
        return

    def onerror(
        func: object, p: str, exc_info: tuple[type[BaseException], BaseException, object]
    ) -> None:
        exc = exc_info[1]
        if isinstance(exc, FileNotFoundError):
            return
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.rmdir(p)
            else:
                os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError:
            raise exc from None

    if path.exists():
        shutil.rmtree(path, onerror=onerror)


def private_dir(path: Path) -> Path:
    """`path` as a directory only root enters (created with its parents if missing; an
    existing one is tightened, never loosened)."""
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    _tighten(path, PRIVATE_DIR)
    return path


def private_sqlite(path: Path) -> Path:
    """Readies `path` for sqlite3.connect as a database only root reads: created 0600 if
    missing (SQLite gives its -wal and -shm files the database's mode), and the database and
    its side files of an older home tightened."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, PRIVATE_FILE))
    for p in (path, *(path.with_name(path.name + side) for side in _SQLITE_SIDE_FILES)):
        _tighten(p, PRIVATE_FILE)
    return path


def private_tree(root: Path, *, whole: tuple[str, ...] = ()) -> None:
    """Makes `root` (a state directory: $AENV_HOME, a snapshot repository) 0700 and tightens
    what lies directly in it, directories to 0700 and files to 0600, and the files of the
    subdirectories named in `whole` (secrets) as well. The root alone keeps other users out;
    the rest holds should it ever be loosened. Deeper trees (layers, uppers) keep their modes:
    they are what sandboxes see."""
    private_dir(root)
    for entry in _entries(root):
        if entry.is_dir(follow_symlinks=False):
            _tighten(Path(entry.path), PRIVATE_DIR)
            if entry.name in whole:
                for inner in _entries(Path(entry.path)):
                    if inner.is_file(follow_symlinks=False):
                        _tighten(Path(inner.path), PRIVATE_FILE)
        elif entry.is_file(follow_symlinks=False):
            _tighten(Path(entry.path), PRIVATE_FILE)


def _entries(d: Path) -> list[os.DirEntry[str]]:
    with os.scandir(d) as it:
        return list(it)


def _tighten(path: Path, mode: int) -> None:
    """Drops the bits of `path`'s mode beyond `mode` (a missing path or a symlink is left
    alone; a mount point that refuses chmod, e.g. read-only, too)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        return
    current = stat.S_IMODE(st.st_mode)
    if current & ~mode:
        with contextlib.suppress(OSError):
            os.chmod(path, current & mode)
