"""``filesystem.Filesystem``: stat, list, make dirs, move, remove, watch.

envd runs as root; operations are done as root and whatever is created is
chowned to the calling user. Relative paths resolve against the user's home.
File metadata (``X-Metadata-*`` on uploads) lives in ``user.e2b.<key>`` xattrs
when the filesystem allows it, else in an in-memory map.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import stat as st
import uuid
from collections import deque
from typing import TYPE_CHECKING

from .rpc import Ctx, Method, Msg, RPCError, Send, as_bool, as_int, as_str, field, timestamp
from .state import User, resolve_path

if TYPE_CHECKING:
    from .inotify import DirWatcher
    from .state import State, Users

XATTR_PREFIX = "user.e2b."
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse", "sshfs", "afs", "ceph", "glusterfs")
WATCH_QUEUE_MAX = 100_000


class Metadata:
    """User metadata per file: xattrs first, in-memory fallback."""

    def __init__(self) -> None:
        self.mem: dict[str, dict[str, str]] = {}

    def get(self, path: str) -> dict[str, str]:
        out: dict[str, str] = {}
        try:
            for name in os.listxattr(path, follow_symlinks=False):
                if name.startswith(XATTR_PREFIX):
                    try:
                        val = os.getxattr(path, name, follow_symlinks=False)
                    except OSError:
                        continue
                    out[name[len(XATTR_PREFIX) :]] = val.decode("utf-8", "replace")
        except OSError:
            pass
        mem = self.mem.get(path)
        if mem:
            out.update(mem)
        return out

    def set(self, path: str, meta: dict[str, str]) -> None:
        fallback: dict[str, str] = {}
        for k, v in meta.items():
            try:
                os.setxattr(path, XATTR_PREFIX + k, v.encode(), follow_symlinks=False)
            except OSError:
                fallback[k] = v
        if fallback:
            self.mem.setdefault(path, {}).update(fallback)

    def replace(self, path: str, meta: dict[str, str]) -> None:
        """A write's metadata is the file's whole metadata: what an earlier write left (an
        xattr on a file truncated in place, the in-memory fallback) goes."""
        try:
            names = os.listxattr(path, follow_symlinks=False)
        except OSError:
            names = []
        for name in names:
            if name.startswith(XATTR_PREFIX):
                with contextlib.suppress(OSError):
                    os.removexattr(path, name, follow_symlinks=False)
        self.mem.pop(path, None)
        if meta:
            self.set(path, meta)

    def forget(self, path: str) -> None:
        if not self.mem:
            return
        prefix = path.rstrip("/") + "/"
        for p in [p for p in self.mem if p == path or p.startswith(prefix)]:
            del self.mem[p]

    def move(self, src: str, dst: str) -> None:
        if not self.mem:
            return
        prefix = src.rstrip("/") + "/"
        for p in [p for p in self.mem if p == src or p.startswith(prefix)]:
            self.mem[dst + p[len(src) :]] = self.mem.pop(p)


def go_perm_string(mode: int) -> str:
    """Permissions the way Go's fs.FileMode.String() prints them (envd is Go)."""
    kinds = ""
    if st.S_ISDIR(mode):
        kinds += "d"
    elif st.S_ISLNK(mode):
        kinds += "L"
    elif st.S_ISBLK(mode):
        kinds += "D"
    elif st.S_ISCHR(mode):
        kinds += "Dc"
    elif st.S_ISFIFO(mode):
        kinds += "p"
    elif st.S_ISSOCK(mode):
        kinds += "S"
    if mode & st.S_ISUID:
        kinds += "u"
    if mode & st.S_ISGID:
        kinds += "g"
    if mode & st.S_ISVTX:
        kinds += "t"
    rwx = "".join(c if mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))
    return (kinds or "-") + rwx


def file_type(mode: int) -> str:
    if st.S_ISDIR(mode):
        return "FILE_TYPE_DIRECTORY"
    if st.S_ISLNK(mode):
        return "FILE_TYPE_SYMLINK"
    return "FILE_TYPE_FILE"


# What a directory's size is when its filesystem says nothing useful.
_DIR_BLOCK = 4096


def entry_size(info: os.stat_result) -> int:
    """The size E2B reports: a file's bytes; a directory's rounded up to whole blocks, at
    least one. ext4 (E2B's disks) gives a directory 4096 per block, but btrfs (our default
    pool) gives the length of its names (0 when empty) and overlay passes that through; E2B's
    SDK tests expect a directory above 0, so every storage kind answers as ext4 would."""
    if not st.S_ISDIR(info.st_mode):
        return info.st_size
    block = info.st_blksize if info.st_blksize > 0 else _DIR_BLOCK
    return max(1, -(-info.st_size // block)) * block


def entry_info(path: str, users: Users, meta: Metadata | None = None) -> Msg:
    """EntryInfo for path (not following a final symlink for identity)."""
    lst = os.lstat(path)
    info = lst
    is_link = st.S_ISLNK(lst.st_mode)
    out: Msg = {"name": os.path.basename(path) or "/", "path": path}
    if is_link:
        try:
            info = os.stat(path)
        except OSError:
            info = lst
        try:
            target = os.readlink(path)
            out["symlinkTarget"] = os.path.normpath(os.path.join(os.path.dirname(path), target))
        except OSError:
            pass
        out["isSymlink"] = True
    out["type"] = file_type(info.st_mode)
    out["size"] = str(entry_size(info))
    out["mode"] = info.st_mode & 0o777
    out["permissions"] = go_perm_string(lst.st_mode if is_link else info.st_mode)
    out["owner"] = users.uid_name(lst.st_uid)
    out["group"] = users.gid_name(lst.st_gid)
    out["modifiedTime"] = timestamp(
        lst.st_mtime_ns // 1_000_000_000, lst.st_mtime_ns % 1_000_000_000
    )
    if meta is not None:
        md = meta.get(path)
        if md:
            out["metadata"] = md
    return out


def make_dirs(path: str, user: User) -> bool:
    """mkdir -p, chowning every created directory to user; False if it existed."""
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    if not missing:
        if not os.path.isdir(path):
            raise NotADirectoryError(path)
        return False
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o755)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
            continue
        with contextlib.suppress(OSError):
            os.chown(d, user.uid, user.gid)
    return True


# What the path itself provokes (too long, a symlink loop): the caller's mistake, not envd's.
PATH_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ELOOP})


def os_error(e: OSError, path: str) -> RPCError:
    if isinstance(e, FileNotFoundError):
        return RPCError("not_found", f"path '{path}' not found")
    if isinstance(e, FileExistsError):
        return RPCError("already_exists", f"path '{path}' already exists")
    if isinstance(e, PermissionError):
        return RPCError("permission_denied", f"permission denied: '{path}'")
    if isinstance(e, NotADirectoryError):
        return RPCError("invalid_argument", f"path '{path}' is not a directory")
    if isinstance(e, IsADirectoryError):
        return RPCError("invalid_argument", f"path '{path}' is a directory")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return RPCError("resource_exhausted", f"not enough space: {e}")
    if e.errno in PATH_ERRNOS:
        return RPCError("invalid_argument", f"path '{path}': {e.strerror}")
    return RPCError("internal", f"{path}: {e.strerror or e}")


def is_network_mount(path: str) -> bool:
    best, fstype = "", ""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
                    best
                ):
                    best, fstype = mnt, parts[2]
    except OSError:
        return False
    return fstype in NETWORK_FS or fstype.startswith("fuse.")


class Watch:
    """A watcher plus its event sink (stream callback or polling queue)."""

    def __init__(self, fs: Filesystem, path: str, recursive: bool, include_entry: bool) -> None:
        self.fs = fs
        self.path = path
        self.include_entry = include_entry
        self.events: deque[Msg] = deque(maxlen=WATCH_QUEUE_MAX)
        self.notify: asyncio.Event | None = None
        self.watcher: DirWatcher | None = None
        self.recursive = recursive

    def start(self) -> None:
        from .inotify import DirWatcher

        self.watcher = DirWatcher(self.path, self.recursive, self._on_event)
        self.watcher.start()

    def _on_event(self, name: str, etype: str, path: str) -> None:
        ev: Msg = {"name": name, "type": etype}
        if self.include_entry and etype != "EVENT_TYPE_REMOVE" and etype != "EVENT_TYPE_RENAME":
            with contextlib.suppress(OSError):
                ev["entry"] = entry_info(path, self.fs.state.users, self.fs.meta)
        self.events.append(ev)
        if self.notify is not None:
            self.notify.set()

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()


class Filesystem:
    def __init__(self, state: State) -> None:
        self.state = state
        self.meta = Metadata()
        self.watchers: dict[str, Watch] = {}

    def _path(self, ctx: Ctx, msg: Msg, name: str = "path") -> str:
        raw = as_str(msg.get(name), name)
        if not raw:
            raise RPCError("invalid_argument", f"{name} is required")
        try:
            return resolve_path(raw, ctx.user)
        except ValueError as e:
            raise RPCError("invalid_argument", f"{name}: {e}") from None

    def _entry(self, path: str) -> Msg:
        try:
            return entry_info(path, self.state.users, self.meta)
        except OSError as e:
            raise os_error(e, path) from None

    def stat(self, ctx: Ctx, msg: Msg) -> Msg:
        return {"entry": self._entry(self._path(ctx, msg))}

    def make_dir(self, ctx: Ctx, msg: Msg) -> Msg:
        path = self._path(ctx, msg)
        try:
            if os.path.lexists(path):
                if os.path.isdir(path):
                    raise RPCError("already_exists", f"directory '{path}' already exists")
                raise RPCError(
                    "invalid_argument", f"path '{path}' already exists and is not a directory"
                )
            make_dirs(path, ctx.user)
        except OSError as e:
            raise os_error(e, path) from None
        return {"entry": self._entry(path)}

    def move(self, ctx: Ctx, msg: Msg) -> Msg:
        src = self._path(ctx, msg, "source")
        dst = self._path(ctx, msg, "destination")
        try:
            if not os.path.lexists(src):
                raise RPCError("not_found", f"path '{src}' not found")
            make_dirs(os.path.dirname(dst) or "/", ctx.user)
            try:
                os.rename(src, dst)
            except OSError as e:
                import errno

                if e.errno != errno.EXDEV:
                    raise
                shutil.move(src, dst)
        except OSError as e:
            raise os_error(e, src) from None
        self.meta.move(src, dst)
        return {"entry": self._entry(dst)}

    def list_dir(self, ctx: Ctx, msg: Msg) -> Msg:
        path = self._path(ctx, msg)
        depth = as_int(msg.get("depth"), "depth", 1) or 1
        try:
            lst = os.stat(path)
        except OSError as e:
            raise os_error(e, path) from None
        if not st.S_ISDIR(lst.st_mode):
            raise RPCError("invalid_argument", f"path '{path}' is not a directory")
        entries: list[Msg] = []
        try:
            names = sorted(os.listdir(path))
        except OSError as e:
            raise os_error(e, path) from None
        self._walk(path, names, depth, entries)
        return {"entries": entries}

    def _walk(self, path: str, names: list[str], depth: int, out: list[Msg]) -> None:
        for name in names:
            child = os.path.join(path, name)
            try:
                info = entry_info(child, self.state.users, self.meta)
            except OSError:
                continue
            out.append(info)
            if depth > 1 and info["type"] == "FILE_TYPE_DIRECTORY" and not info.get("isSymlink"):
                try:
                    sub = sorted(os.listdir(child))
                except OSError:  # unreadable subdirectory: listed, not descended
                    continue
                self._walk(child, sub, depth - 1, out)

    def remove(self, ctx: Ctx, msg: Msg) -> Msg:
        path = self._path(ctx, msg)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass  # like envd (os.RemoveAll): removing a missing path succeeds
        except OSError as e:
            raise os_error(e, path) from None
        self.meta.forget(path)
        return {}

    def _new_watch(self, ctx: Ctx, msg: Msg) -> Watch:
        path = self._path(ctx, msg)
        try:
            info = os.stat(path)
        except OSError as e:
            raise os_error(e, path) from None
        if not st.S_ISDIR(info.st_mode):
            raise RPCError("invalid_argument", f"path '{path}' is not a directory")
        if not as_bool(
            field(msg, "allowNetworkMounts", "allow_network_mounts")
        ) and is_network_mount(path):
            raise RPCError(
                "failed_precondition",
                f"path '{path}' is on a network filesystem; set allow_network_mounts to watch it",
            )
        w = Watch(
            self,
            path,
            as_bool(msg.get("recursive")),
            as_bool(field(msg, "includeEntry", "include_entry")),
        )
        try:
            w.start()
        except OSError as e:
            raise os_error(e, path) from None
        return w

    async def watch_dir(self, ctx: Ctx, msg: Msg, send: Send) -> None:
        w = self._new_watch(ctx, msg)
        w.notify = asyncio.Event()
        try:
            await send({"start": {}})
            while True:
                await w.notify.wait()
                w.notify.clear()
                while w.events:
                    await send({"filesystem": w.events.popleft()})
        finally:
            w.close()

    def create_watcher(self, ctx: Ctx, msg: Msg) -> Msg:
        w = self._new_watch(ctx, msg)
        wid = str(uuid.uuid4())
        self.watchers[wid] = w
        return {"watcherId": wid}

    def _watcher(self, msg: Msg) -> tuple[str, Watch]:
        wid = as_str(field(msg, "watcherId", "watcher_id"), "watcherId")
        w = self.watchers.get(wid)
        if w is None:
            raise RPCError("not_found", f"watcher '{wid}' not found")
        return wid, w

    def get_watcher_events(self, ctx: Ctx, msg: Msg) -> Msg:
        _, w = self._watcher(msg)
        events = list(w.events)
        w.events.clear()
        return {"events": events}

    def remove_watcher(self, ctx: Ctx, msg: Msg) -> Msg:
        wid, w = self._watcher(msg)
        w.close()
        del self.watchers[wid]
        return {}

    def methods(self) -> dict[str, Method]:
        p = "/filesystem.Filesystem/"
        return {
            p + "Stat": Method("unary", self.stat),
            p + "MakeDir": Method("unary", self.make_dir),
            p + "Move": Method("unary", self.move),
            p + "ListDir": Method("unary", self.list_dir),
            p + "Remove": Method("unary", self.remove),
            p + "WatchDir": Method("server", self.watch_dir, {"keepalive": {}}),
            p + "CreateWatcher": Method("unary", self.create_watcher),
            p + "GetWatcherEvents": Method("unary", self.get_watcher_events),
            p + "RemoveWatcher": Method("unary", self.remove_watcher),
        }
