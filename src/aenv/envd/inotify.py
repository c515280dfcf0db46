"""Directory watching with Linux inotify, through ctypes (no third-party code).

A ``DirWatcher`` watches one directory, optionally recursively (one inotify
watch per subdirectory, including directories created later), and turns raw
inotify events into E2B ``FilesystemEvent`` dicts delivered to a callback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import struct
from collections.abc import Callable

IN_ACCESS = 0x00000001
IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000

WATCH_MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
)

_HEADER = struct.Struct("iIII")
_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.inotify_init1.argtypes = [ctypes.c_int]
        lib.inotify_init1.restype = ctypes.c_int
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        lib.inotify_add_watch.restype = ctypes.c_int
        lib.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.inotify_rm_watch.restype = ctypes.c_int
        _libc = lib
    return _libc


def event_type(mask: int) -> str | None:
    """Map an inotify mask to an E2B EventType name (fsnotify's mapping)."""
    if mask & (IN_CREATE | IN_MOVED_TO):
        return "EVENT_TYPE_CREATE"
    if mask & IN_MODIFY:
        return "EVENT_TYPE_WRITE"
    if mask & IN_DELETE:
        return "EVENT_TYPE_REMOVE"
    if mask & IN_MOVED_FROM:
        return "EVENT_TYPE_RENAME"
    if mask & IN_ATTRIB:
        return "EVENT_TYPE_CHMOD"
    return None


class DirWatcher:
    """inotify-backed watcher; ``on_event(name, type, abs_path)`` gets each event."""

    def __init__(
        self,
        root: str,
        recursive: bool,
        on_event: Callable[[str, str, str], None],
    ) -> None:
        self.root = root.rstrip("/") or "/"
        self.recursive = recursive
        self.on_event = on_event
        self.wds: dict[int, str] = {}  # watch descriptor -> absolute directory path
        self.fd = -1
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    def start(self) -> None:
        lib = _lib()
        fd = lib.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd = fd
        try:
            self._add(self.root, must=True)
            if self.recursive:
                self._add_tree(self.root)
        except BaseException:
            self.close()
            raise
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(fd, self._on_readable)

    def _add(self, path: str, must: bool = False) -> None:
        wd = _lib().inotify_add_watch(self.fd, os.fsencode(path), WATCH_MASK)
        if wd < 0:
            err = ctypes.get_errno()
            if must:
                raise OSError(err, f"inotify_add_watch {path}: {os.strerror(err)}")
            return
        self.wds[wd] = path

    def _add_tree(self, top: str) -> None:
        for dirpath, dirnames, _ in os.walk(top, followlinks=False):
            for d in dirnames:
                p = os.path.join(dirpath, d)
                if not os.path.islink(p):
                    self._add(p)

    def _on_readable(self) -> None:
        try:
            data = os.read(self.fd, 256 * 1024)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        off = 0
        while off + _HEADER.size <= len(data):
            wd, mask, _cookie, length = _HEADER.unpack_from(data, off)
            off += _HEADER.size
            raw = data[off : off + length].split(b"\0", 1)[0]
            off += length
            self._handle(wd, mask, os.fsdecode(raw))

    def _handle(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_IGNORED:
            self.wds.pop(wd, None)
            return
        base = self.wds.get(wd)
        if base is None:
            return
        if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
            if base == self.root:  # the watched directory itself is gone
                rel = os.path.basename(self.root)
                self.on_event(rel, "EVENT_TYPE_REMOVE", self.root)
            return
        if not name:
            return
        path = os.path.join(base, name)
        if self.recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
            self._add(path)
            self._add_tree(path)
        etype = event_type(mask)
        if etype is None:
            return
        rel = os.path.relpath(path, self.root)
        self.on_event(rel, etype, path)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.fd >= 0:
            if self.loop is not None:
                with contextlib.suppress(Exception):
                    self.loop.remove_reader(self.fd)
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
