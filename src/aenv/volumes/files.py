"""The files of one volume as `/volumecontent` serves them (E2B's volume content API).

This runs as root on the host, on a tree sandboxes write: a sandbox may plant a symbolic
link to anywhere on the host. So no link is ever followed: each path component is opened
relative to its parent's descriptor with O_NOFOLLOW, and a path through a link is refused.
Paths are relative to the volume's top, with or without a leading `/`; `..` stops there.
Blocking: the server runs these in a thread."""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import secrets
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import AenvError, BadRequest, Conflict, InsufficientStorage, NotFound

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
DEFAULT_FILE_MODE = 0o644
DEFAULT_DIR_MODE = 0o755
MAX_DEPTH = 32


@dataclass(frozen=True)
class EntryStat:
    """E2B's VolumeEntryStat: `mode` holds the permission bits only, as E2B's has it."""

    name: str
    type: str  # file, directory, symlink, unknown
    path: str
    size: int
    mode: int
    uid: int
    gid: int
    atime: datetime
    mtime: datetime
    ctime: datetime
    target: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "type": self.type,
            "path": self.path,
            "size": self.size,
            "mode": self.mode,
            "uid": self.uid,
            "gid": self.gid,
            "atime": self.atime.isoformat(),
            "mtime": self.mtime.isoformat(),
            "ctime": self.ctime.isoformat(),
        }
        if self.target is not None:
            out["target"] = self.target
        return out


def normalize(path: str) -> str:
    """`/a/b` for `a/b`, `/a/./b/`, `//a/b` or `/../a/b`; BadRequest for a NUL."""
    if "\0" in path:
        raise BadRequest("path contains a NUL character")
    return posixpath.normpath("/" + path.lstrip("/")).replace("//", "/")


def _when(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "unknown"


def _entry(path: str, st: os.stat_result, target: str | None = None) -> EntryStat:
    return EntryStat(
        name=posixpath.basename(path) or "/",
        type=_kind(st.st_mode),
        path=path,
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        uid=st.st_uid,
        gid=st.st_gid,
        atime=_when(st.st_atime),
        mtime=_when(st.st_mtime),
        ctime=_when(st.st_ctime),
        target=target,
    )


def _os_error(e: OSError, path: str) -> AenvError:
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return NotFound(f"path {path} not found")
    if e.errno == errno.ELOOP:
        return BadRequest(f"path {path} goes through a symbolic link (links are not followed)")
    if e.errno == errno.EEXIST:
        return Conflict(f"path {path} already exists")
    if e.errno in (errno.EISDIR, errno.ENOTEMPTY):
        return Conflict(f"path {path} is a directory")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientStorage(f"no space left on the volume writing {path}")
    if e.errno == errno.ENAMETOOLONG:
        return BadRequest(f"path {path}: a name is too long")
    return AenvError(f"{path}: {e.strerror or e}")


@contextlib.contextmanager
def _errors(path: str) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise _os_error(e, path) from None


class VolumeFiles:
    def __init__(self, top: Path) -> None:
        self.top = top

    @contextlib.contextmanager
    def _parent(
        self, path: str, *, create: tuple[int, int | None, int | None] | None = None
    ) -> Iterator[tuple[int, str, str]]:
        """(descriptor of the parent directory, last name, normalized path); the top itself
        is (its descriptor, "", "/"). `create` (mode, uid, gid): missing parents are made
        (owned as their own parent when uid/gid are None)."""
        norm = normalize(path)
        parts = [p for p in norm.split("/") if p]
        fds: list[int] = []
        try:
            with _errors(norm):
                fds.append(os.open(self.top, _DIR))
                for part in parts[:-1]:
                    if create is not None:
                        with contextlib.suppress(FileExistsError):
                            os.mkdir(part, 0o700, dir_fd=fds[-1])
                            _own(part, fds[-1], *_inherit(fds[-1], *create))
                    fds.append(_open_dir(part, fds[-1], norm))
            yield fds[-1], (parts[-1] if parts else ""), norm
        finally:
            for fd in fds:
                os.close(fd)

    # ------------------------------------------------------------------ reading
    def stat(self, path: str) -> EntryStat:
        with self._parent(path) as (fd, name, norm), _errors(norm):
            if not name:
                return _entry(norm, os.fstat(fd))
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            target = os.readlink(name, dir_fd=fd) if stat.S_ISLNK(st.st_mode) else None
            return _entry(norm, st, target)

    def list_dir(self, path: str, depth: int = 1) -> list[EntryStat]:
        out: list[EntryStat] = []
        with self._parent(path) as (fd, name, norm), _errors(norm):
            dfd = _open_dir(name, fd, norm) if name else os.dup(fd)
            try:
                self._scan(dfd, norm, max(1, min(depth, MAX_DEPTH)), out)
            finally:
                os.close(dfd)
        return out

    def _scan(self, dfd: int, base: str, depth: int, out: list[EntryStat]) -> None:
        for name in sorted(os.listdir(dfd)):
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                target = os.readlink(name, dir_fd=dfd) if stat.S_ISLNK(st.st_mode) else None
            except FileNotFoundError:  # removed meanwhile (a sandbox works in it)
                continue
            child = posixpath.join(base, name)
            out.append(_entry(child, st, target))
            if depth > 1 and stat.S_ISDIR(st.st_mode):
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    cfd = os.open(name, _DIR, dir_fd=dfd)
                    try:
                        self._scan(cfd, child, depth - 1, out)
                    finally:
                        os.close(cfd)

    def open_file(self, path: str) -> tuple[BinaryIO, int]:
        """A regular file, opened for reading, and its size; the caller closes it."""
        with self._parent(path) as (fd, name, norm), _errors(norm):
            if not name:
                raise NotFound(f"path {norm} is not a file")
            ffd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd
            )
            st = os.fstat(ffd)
            if not stat.S_ISREG(st.st_mode):
                os.close(ffd)
                raise NotFound(f"path {norm} is not a file")
            return os.fdopen(ffd, "rb"), st.st_size

    # ------------------------------------------------------------------ writing
    def make_dir(
        self,
        path: str,
        *,
        uid: int | None = None,
        gid: int | None = None,
        mode: int | None = None,
        force: bool = False,
    ) -> EntryStat:
        """`force`: parents are made too, and an existing directory is no error."""
        m = DEFAULT_DIR_MODE if mode is None else _mode(mode)
        with (
            self._parent(path, create=(m, uid, gid) if force else None) as (fd, name, norm),
            _errors(norm),
        ):
            if not name:
                if force:
                    return _entry(norm, os.fstat(fd))
                raise Conflict(f"path {norm} already exists")
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
            except FileExistsError:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if force and stat.S_ISDIR(st.st_mode):
                    return _entry(norm, st)
                raise Conflict(f"path {norm} already exists") from None
            _own(name, fd, *_inherit(fd, m, uid, gid))
            return _entry(norm, os.stat(name, dir_fd=fd, follow_symlinks=False))

    @contextlib.contextmanager
    def writer(
        self,
        path: str,
        *,
        uid: int | None = None,
        gid: int | None = None,
        mode: int | None = None,
        overwrite: bool = True,
    ) -> Iterator[Upload]:
        """An upload into a temporary file beside the target, put in place whole by
        `Upload.commit` (readers never see a part); dropped if the block raises first."""
        m = DEFAULT_FILE_MODE if mode is None else _mode(mode)
        with self._parent(path) as (fd, name, norm), _errors(norm):
            if not name:
                raise Conflict(f"path {norm} is a directory")
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    raise Conflict(f"path {norm} is a directory")
                if not overwrite:
                    raise Conflict(f"path {norm} already exists")
            tmp = f".aenv-upload-{secrets.token_hex(8)}"
            tfd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=fd,
            )
            up = Upload(tfd, fd, tmp, name, norm, _inherit(fd, m, uid, gid), overwrite)
            try:
                yield up
            finally:
                up.close()

    def update(
        self, path: str, *, uid: int | None = None, gid: int | None = None, mode: int | None = None
    ) -> EntryStat:
        """Changes owner and/or mode (a link's mode cannot change: BadRequest)."""
        with self._parent(path) as (fd, name, norm), _errors(norm):
            target = name or "."
            st = os.stat(target, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode) and mode is not None:
                raise BadRequest(f"path {norm} is a symbolic link: its mode cannot change")
            new_mode = stat.S_IMODE(st.st_mode) if mode is None else _mode(mode)
            uid_ = st.st_uid if uid is None else uid
            gid_ = st.st_gid if gid is None else gid
            if stat.S_ISLNK(st.st_mode):
                os.chown(target, uid_, gid_, dir_fd=fd, follow_symlinks=False)
            else:
                _own(target, fd, new_mode, uid_, gid_)
            return self.stat(norm)

    def remove(self, path: str) -> None:
        """A file, link or whole directory tree."""
        with self._parent(path) as (fd, name, norm), _errors(norm):
            if not name:
                raise BadRequest("the volume's top directory cannot be removed")
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=fd)  # descriptor-based: follows no link
            else:
                os.unlink(name, dir_fd=fd)


class Upload:
    def __init__(
        self,
        fd: int,
        dir_fd: int,
        tmp: str,
        name: str,
        path: str,
        owner: tuple[int, int, int],
        overwrite: bool,
    ) -> None:
        self.fd, self.dir_fd, self.tmp, self.name, self.path = fd, dir_fd, tmp, name, path
        self.owner, self.overwrite = owner, overwrite
        self.done = False

    def write(self, chunk: bytes) -> None:
        with _errors(self.path):
            view = memoryview(chunk)
            while view:
                view = view[os.write(self.fd, view) :]

    def commit(self) -> EntryStat:
        mode, uid, gid = self.owner
        with _errors(self.path):
            os.fchown(self.fd, uid, gid)
            os.fchmod(self.fd, mode)  # after the chown, which drops set-id bits
            if self.overwrite:
                os.rename(self.tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            else:  # a link is made only where nothing is: no race with another writer
                os.link(
                    self.tmp,
                    self.name,
                    src_dir_fd=self.dir_fd,
                    dst_dir_fd=self.dir_fd,
                    follow_symlinks=False,
                )
                os.unlink(self.tmp, dir_fd=self.dir_fd)
            self.done = True
            return _entry(self.path, os.fstat(self.fd))

    def close(self) -> None:
        os.close(self.fd)
        if not self.done:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp, dir_fd=self.dir_fd)


def _open_dir(name: str, dir_fd: int, path: str) -> int:
    """A descriptor of directory `name` in dir_fd; a link there is refused, not followed
    (O_NOFOLLOW with O_DIRECTORY says ENOTDIR for one)."""
    try:
        return os.open(name, _DIR, dir_fd=dir_fd)
    except NotADirectoryError:
        if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise _os_error(OSError(errno.ELOOP, "symbolic link"), path) from None
        raise


def _own(name: str, dir_fd: int, mode: int, uid: int, gid: int) -> None:
    """chown + chmod of `name` in dir_fd, through a descriptor of it (no link followed)."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        via = f"/proc/self/fd/{fd}"
        os.chown(via, uid, gid)
        os.chmod(via, mode)
    finally:
        os.close(fd)


def _inherit(dir_fd: int, mode: int, uid: int | None, gid: int | None) -> tuple[int, int, int]:
    """(mode, uid, gid) of a new entry: what was asked, else its directory's owner (so
    what the API writes in a volume, whose top is the sandbox user's, stays theirs)."""
    st = os.fstat(dir_fd)
    return mode, st.st_uid if uid is None else uid, st.st_gid if gid is None else gid


def _mode(mode: int) -> int:
    if not 0 <= mode <= 0o7777:
        raise BadRequest(f"invalid mode {mode:#o}: permission bits only (at most 0o7777)")
    return mode
