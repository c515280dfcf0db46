"""Small file-system primitives shared by the stores: locks, durability, removal."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def flock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created if missing), held for the block: serialises
    processes that fill one machine-wide cache entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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
