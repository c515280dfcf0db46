"""A /proc that forgets dead processes, so a sandbox's checkpoint does not grow with its history.

gVisor's procfs keeps up to 1,000 unreferenced dentries (its default `dentry_cache_limit`),
and every exec leaves one for `/proc/<pid>` holding the dead task: ~115 KiB each in a
checkpoint, so a sandbox that ran 1,000 commands checkpoints ~115 MB more than a fresh one
(and takes that much longer to snapshot, hibernate and fork). runsc ignores mount options of
the spec's `proc` mount, so envd, as the sandbox's first process, mounts a fresh procfs with
the cache off over the runtime's, then gives up CAP_SYS_ADMIN for good (dropped from the
bounding set: nothing it starts can get it back, exactly as without this step).

Stdlib only (ctypes), like the rest of envd. Every step is best effort: a sandbox without
CAP_SYS_ADMIN (an older spec) keeps the runtime's /proc and runs as before.
"""

from __future__ import annotations

import ctypes
import os
import sys

PROC_OPTIONS = "dentry_cache_limit=0"
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MNT_DETACH = 2
_PR_CAPBSET_DROP = 24
_CAP_SYS_ADMIN = 21


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def remount_proc(libc: ctypes.CDLL | None = None) -> str | None:
    """Mounts /proc anew with the dentry cache off; None on success, else why not."""
    libc = libc or _libc()
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    # Detach first: a procfs stacked on the old one would leave the old one's cache alive.
    if libc.umount2(b"/proc", _MNT_DETACH) != 0:
        return f"umount /proc: {os.strerror(ctypes.get_errno())}"
    if libc.mount(b"proc", b"/proc", b"proc", flags, PROC_OPTIONS.encode()) != 0:
        err = os.strerror(ctypes.get_errno())
        # Without /proc much inside breaks (ps, bash's job control): mount it as it was.
        libc.mount(b"proc", b"/proc", b"proc", flags, None)
        return f"mount /proc ({PROC_OPTIONS}): {err}"
    return None


def drop_sys_admin(libc: ctypes.CDLL | None = None) -> str | None:
    """Removes CAP_SYS_ADMIN from the bounding set (inherited by every child; an exec can
    no longer gain it). None on success, else why not."""
    libc = libc or _libc()
    if libc.prctl(_PR_CAPBSET_DROP, _CAP_SYS_ADMIN, 0, 0, 0) != 0:
        return f"drop CAP_SYS_ADMIN: {os.strerror(ctypes.get_errno())}"
    return None


def prepare_proc() -> None:
    """At the start of a sandbox's first process, before anything else runs in it."""
    try:
        libc = _libc()
    except OSError as exc:  # pragma: no cover - a bundle without ctypes
        sys.stderr.write(f"envd: /proc left as it is: {exc}\n")
        return
    for step in (remount_proc, drop_sys_admin):
        problem = step(libc)
        if problem:
            sys.stderr.write(f"envd: {problem}\n")
