"""envd's /proc preparation, against a recording stand-in for libc (the real calls need a
sandbox: tests/integration/test_history.py)."""

from __future__ import annotations

import ctypes
from typing import Any, cast

from aenv.envd import procfs


class Libc:
    def __init__(self, fail: set[str] | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail or set()

    def _call(self, name: str, *args: Any) -> int:
        self.calls.append((name, *args))
        if name in self.fail:
            ctypes.set_errno(1)
            self.fail.discard(name)  # only the first call of that name fails
            return -1
        return 0

    def umount2(self, *args: Any) -> int:
        return self._call("umount2", *args)

    def mount(self, *args: Any) -> int:
        return self._call("mount", *args)

    def prctl(self, *args: Any) -> int:
        return self._call("prctl", *args)


def as_libc(fake: Libc) -> ctypes.CDLL:
    return cast(ctypes.CDLL, fake)


def test_detaches_the_old_proc_then_mounts_one_without_a_dentry_cache() -> None:
    libc = Libc()
    assert procfs.remount_proc(as_libc(libc)) is None
    assert [c[0] for c in libc.calls] == ["umount2", "mount"]
    assert libc.calls[0][1] == b"/proc"
    assert libc.calls[1][1:4] == (b"proc", b"/proc", b"proc")
    assert libc.calls[1][5] == b"dentry_cache_limit=0"


def test_a_refused_mount_puts_a_plain_proc_back() -> None:
    libc = Libc(fail={"mount"})
    problem = procfs.remount_proc(as_libc(libc))
    assert problem is not None and "dentry_cache_limit=0" in problem
    assert [c[0] for c in libc.calls] == ["umount2", "mount", "mount"]
    assert libc.calls[2][5] is None


def test_without_the_capability_proc_is_left_alone() -> None:
    libc = Libc(fail={"umount2"})
    problem = procfs.remount_proc(as_libc(libc))
    assert problem is not None and problem.startswith("umount /proc")
    assert [c[0] for c in libc.calls] == ["umount2"]


def test_sys_admin_leaves_the_bounding_set() -> None:
    libc = Libc()
    assert procfs.drop_sys_admin(as_libc(libc)) is None
    assert libc.calls == [("prctl", 24, 21, 0, 0, 0)]
