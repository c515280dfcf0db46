"""A repository in a local directory: ``<root>/<key>`` is the object's file.

Writes go to ``<root>/.tmp`` first (same filesystem), are fsynced, renamed into place, and
the parent directory is fsynced, so a crash (kill -9, power loss) leaves either the old
object or the complete new one. Objects are made read-only (0444): other parts of the node
may hard-link them (the image cache does) and must never write through the link. The root is
0700: the objects are sandboxes' files and memory (tokens, set-id binaries), for root only.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import time
import uuid
from pathlib import Path

from ...fsutil import fsync_dir, fsync_file, private_dir
from ..errors import ObjectNotFound, RepositoryError
from .base import CHUNK, HashingFileWriter, ObjectInfo, Repository, check_key, norm_prefix

_OBJECT_MODE = 0o444


class LocalRepository(Repository):
    local_path_capable = True

    def __init__(self, root: Path) -> None:
        root = Path(root)
        if not root.is_absolute():
            raise RepositoryError(f"local repository path must be absolute, got {str(root)!r}")
        self.root = root
        self.tmp = root / ".tmp"
        self.url = f"file://{root}"
        self._private = False

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def local_path(self, key: str) -> Path | None:
        p = self._path(key)
        return p if p.is_file() else None

    # --- writing ---
    def _tmp_file(self) -> Path:
        if not self._private:
            private_dir(self.root)
            self._private = True
        self.tmp.mkdir(parents=True, exist_ok=True)
        return self.tmp / f"{uuid.uuid4().hex}.part"

    def _install(self, tmp: Path, key: str) -> None:
        """fsync tmp, rename it to key's path, fsync the directory."""
        final = self._path(key)
        try:
            os.chmod(tmp, _OBJECT_MODE)
            fsync_file(tmp)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(final.parent)

    def _put_file(self, key: str, path: Path, move: bool) -> None:
        check_key(key)
        if move:
            tmp = self._tmp_file()
            try:
                os.rename(path, tmp)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
            else:
                self._install(tmp, key)
                return
        tmp = self._tmp_file()
        try:
            shutil.copyfile(path, tmp)  # copy_file_range/sendfile: no userland copy
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._install(tmp, key)
        if move:
            Path(path).unlink(missing_ok=True)

    async def put_file(self, key: str, path: Path, *, move: bool = False) -> None:
        try:
            await asyncio.to_thread(self._put_file, key, Path(path), move)
        except FileNotFoundError as e:
            raise RepositoryError(f"cannot store {key!r}: {e}") from e
        except OSError as e:
            raise RepositoryError(f"cannot store {key!r} in {self.url}: {e}") from e

    def _put_bytes(self, key: str, data: bytes) -> None:
        check_key(key)
        tmp = self._tmp_file()
        try:
            tmp.write_bytes(data)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._install(tmp, key)

    async def put_bytes(self, key: str, data: bytes) -> None:
        try:
            await asyncio.to_thread(self._put_bytes, key, bytes(data))
        except OSError as e:
            raise RepositoryError(f"cannot store {key!r} in {self.url}: {e}") from e

    # --- reading ---
    def _get_file(self, key: str, dest: Path, sha256: str | None, size: int | None) -> str:
        src = self._path(key)
        try:
            f = open(src, "rb")  # noqa: SIM115
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(key, f"at {self.url}") from None
        with f:
            w = HashingFileWriter(dest)
            try:
                buf = bytearray(CHUNK)
                view = memoryview(buf)
                while n := f.readinto(buf):
                    w.write(view[:n])
            except BaseException:
                w.abort()
                raise
            return w.commit(key, sha256=sha256, size=size)

    async def get_file(
        self, key: str, dest: Path, *, sha256: str | None = None, size: int | None = None
    ) -> str:
        try:
            return await asyncio.to_thread(self._get_file, key, Path(dest), sha256, size)
        except OSError as e:
            raise RepositoryError(f"cannot read {key!r} from {self.url}: {e}") from e

    def _get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(key, f"at {self.url}") from None

    async def get_bytes(self, key: str) -> bytes:
        try:
            return await asyncio.to_thread(self._get_bytes, key)
        except OSError as e:
            raise RepositoryError(f"cannot read {key!r} from {self.url}: {e}") from e

    def _stat(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not os.path.isfile(self._path(key)):
            return None
        return ObjectInfo(key=key, size=st.st_size, last_modified=st.st_mtime)

    async def stat(self, key: str) -> ObjectInfo | None:
        return await asyncio.to_thread(self._stat, key)

    def _list(self, prefix: str) -> list[ObjectInfo]:
        prefix = norm_prefix(prefix)
        base = self.root / prefix if prefix else self.root
        out: list[ObjectInfo] = []
        if not base.is_dir():
            return out
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if name.startswith("."):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                out.append(ObjectInfo(key=key, size=st.st_size, last_modified=st.st_mtime))
        out.sort(key=lambda o: o.key)
        return out

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        try:
            return await asyncio.to_thread(self._list, prefix)
        except OSError as e:
            raise RepositoryError(f"cannot list {prefix!r} in {self.url}: {e}") from e

    # --- deleting ---
    def _delete(self, key: str) -> None:
        p = self._path(key)
        try:
            p.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        except IsADirectoryError:
            return
        self._prune(p.parent)

    def _prune(self, d: Path) -> None:
        """Removes empty directories from d up to (not including) the root."""
        while d != self.root and self.root in d.parents:
            try:
                d.rmdir()
            except OSError:
                return
            d = d.parent

    async def delete(self, key: str) -> None:
        try:
            await asyncio.to_thread(self._delete, key)
        except OSError as e:
            raise RepositoryError(f"cannot delete {key!r} in {self.url}: {e}") from e

    def _delete_prefix(self, prefix: str) -> int:
        objs = self._list(prefix)
        for o in objs:
            self._delete(o.key)
        return len(objs)

    async def delete_prefix(self, prefix: str) -> int:
        try:
            return await asyncio.to_thread(self._delete_prefix, prefix)
        except OSError as e:
            raise RepositoryError(f"cannot delete {prefix!r} in {self.url}: {e}") from e

    def clean_staging(self, older_than: float = 3600.0) -> int:
        """Removes temp files of interrupted writes older than `older_than` seconds (another
        process may share the repository and be writing right now)."""
        n = 0
        if not self.tmp.is_dir():
            return 0
        now = time.time()
        for entry in self.tmp.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if now - entry.lstat().st_mtime >= older_than:
                    entry.unlink()
                    n += 1
        return n
