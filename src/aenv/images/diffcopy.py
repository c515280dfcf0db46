"""What an overlay upper gained since an earlier copy of it, as a layer of its own.

A live snapshot copies a running sandbox's upper into a layer and lets the sandbox go on in
that same upper. The next snapshot of the sandbox then needs only the difference to that
copy (itself a stack: the first full copy and the differences taken since): entries new or
changed since (compared as rsync's quick check does: type, mode, owner,
size, modification time in ns, link target, device number), whole directories where one
appeared or became opaque, and an overlay whiteout for each entry the copy has and the
upper no longer does. Stacked over the earlier copy, the result shows exactly what the
upper shows (whiteouts are compared as entries, as the upper holds them, never resolved). Writable overlays here run with redirect_dir, metacopy and index off, so an
upper holds nothing else (see runtime/rootfs.py).

A change that keeps size and mtime (an xattr set alone, or a write that restores the mtime
by hand) is not seen, as rsync would not see it either.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..fsutil import clone_file
from .layers import copy_tree

OPAQUE = "trusted.overlay.opaque"


def _opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (
        a.st_mode == b.st_mode
        and a.st_uid == b.st_uid
        and a.st_gid == b.st_gid
        and a.st_size == b.st_size
        and a.st_mtime_ns == b.st_mtime_ns
        and a.st_rdev == b.st_rdev
    )


def _copy_attrs(src: Path, dst: Path, st: os.stat_result) -> None:
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _copy_xattrs(src: Path, dst: Path) -> None:
    for name in os.listxattr(src, follow_symlinks=False):
        try:
            os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False))
        except OSError:
            continue  # one the destination's filesystem does not take


def _copy_entry(src: Path, dst: Path, st: os.stat_result) -> None:
    """One entry as it is (a directory with all it holds)."""
    if stat.S_ISDIR(st.st_mode):
        copy_tree(src, dst, link=False)
        return
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISREG(st.st_mode):
        clone_file(src, dst)
        _copy_xattrs(src, dst)
    else:  # whiteouts (0/0 character devices), devices, fifos, sockets
        os.mknod(dst, st.st_mode, st.st_rdev)
    _copy_attrs(src, dst, st)


def _whiteout(dst: Path) -> None:
    os.mknod(dst, stat.S_IFCHR | 0o000, os.makedev(0, 0))


class _Diff:
    def __init__(self, upper: Path, dst: Path) -> None:
        self.upper, self.dst = upper, dst
        self.written = 0

    def _dir_for(self, rel: Path) -> Path:
        """`dst/rel`, made with the upper's directories' attributes on the way down."""
        target = self.dst / rel
        if target.is_dir():
            return target
        here = self.dst
        for part in rel.parts:
            nxt = here / part
            if not nxt.is_dir():
                src = self.upper / (nxt.relative_to(self.dst))
                os.mkdir(nxt)
                _copy_attrs(src, nxt, os.lstat(src))
            here = nxt
        return target

    def walk(self, rel: Path, view: list[Path]) -> None:
        """Compares the upper's directory `rel` with the same directory of the earlier
        copy, which `view` holds: that directory in each layer of the copy that has it,
        merged as overlayfs merges them (topmost first)."""
        u = self.upper / rel
        with os.scandir(u) as it:
            names = sorted(e.name for e in it)
        before: dict[str, list[Path]] = {}  # name -> its entries in the copy, topmost first
        for d in view:
            with os.scandir(d) as it:
                for e in it:
                    before.setdefault(e.name, []).append(Path(e.path))
        for name in names:
            self._entry(rel / name, _merged(before.pop(name, [])))
        for name, entries in sorted(before.items()):
            if _is_whiteout(os.lstat(entries[0])):
                continue  # gone from the copy already
            _whiteout(self._dir_for(rel) / name)
            self.written += 1
        if rel.parts and (self.dst / rel).is_dir():
            _copy_attrs(u, self.dst / rel, os.lstat(u))  # after its entries: keep its mtime
        elif rel.parts and view and _attrs_differ(os.lstat(u), os.lstat(view[0])):
            self._dir_for(rel)  # only its mode or owner changed: the layer carries it
            self.written += 1

    def _entry(self, rel: Path, old: list[Path]) -> None:
        src = self.upper / rel
        st = os.lstat(src)
        old_st = os.lstat(old[0]) if old else None
        if old_st is not None and stat.S_ISDIR(st.st_mode) and stat.S_ISDIR(old_st.st_mode):
            # A directory that turned opaque hides the copy's: it goes in whole. Otherwise
            # the layer's directory merges with the copy's, so compare inside it.
            if not (_opaque(src) and not _opaque(old[0])):
                self.walk(rel, old)
                return
        elif (
            old_st is not None
            and _same(st, old_st)
            and (not stat.S_ISLNK(st.st_mode) or os.readlink(src) == os.readlink(old[0]))
        ):
            return
        _copy_entry(src, self._dir_for(rel.parent) / rel.name, st)
        self.written += 1


def _merged(entries: list[Path]) -> list[Path]:
    """The entries of one name through the copy's layers that overlayfs shows as one: the
    topmost alone, or for a directory every directory below it down to the first entry
    that is not one, or to an opaque one."""
    if not entries or not stat.S_ISDIR(os.lstat(entries[0]).st_mode):
        return entries[:1]
    out: list[Path] = []
    for e in entries:
        if not stat.S_ISDIR(os.lstat(e).st_mode):
            break
        out.append(e)
        if _opaque(e):
            break
    return out


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _attrs_differ(a: os.stat_result, b: os.stat_result) -> bool:
    return a.st_mode != b.st_mode or (a.st_uid, a.st_gid) != (b.st_uid, b.st_gid)


def copy_changes(upper: Path, copy: list[Path], dst: Path) -> int:
    """Writes into the new directory `dst` what `upper` holds beyond `copy` (an earlier copy
    of the same upper, as a stack of layer directories, topmost first; see the module doc).
    Returns how many entries went in (0: nothing changed, `dst` is left empty)."""
    dst.mkdir()
    diff = _Diff(upper, dst)
    diff.walk(Path(), copy)
    return diff.written
