"""Overlay layers built by hand and the views the kernel gives of them, for the squash tests:
files, directories, whiteouts, opaque directories, links and xattrs written into a layer; a
stack mounted and walked into a comparable view; the hand-built stack the tests squash.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aenv.images.unpack import OPAQUE_XATTR

T0 = 1_600_000_000


# --- building layers by hand ---
def walk(root: Path) -> list[Path]:
    """Every entry below root (symlinks not followed), parents before children."""
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        out.extend(Path(dirpath, n) for n in sorted(dirnames + filenames))
    return out


class Layer:
    """A layer directory written like an unpacked or sealed one. Directory times are set by
    `seal` (after the content), from what `dir` recorded (T0 otherwise)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dir_times: dict[str, int] = {}
        root.mkdir(parents=True)

    def _path(self, rel: str) -> Path:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def dir(
        self,
        rel: str,
        mode: int = 0o755,
        uid: int = 0,
        gid: int = 0,
        mtime: int = T0,
        opaque: bool = False,
        xattrs: dict[str, bytes] | None = None,
    ) -> Layer:
        p = self._path(rel) if rel else self.root
        p.mkdir(exist_ok=True)
        os.chown(p, uid, gid)
        p.chmod(mode)
        if opaque:
            os.setxattr(p, OPAQUE_XATTR, b"y")
        for k, v in (xattrs or {}).items():
            os.setxattr(p, k, v)
        self.dir_times[rel] = mtime
        return self

    def file(
        self,
        rel: str,
        data: bytes = b"",
        mode: int = 0o644,
        uid: int = 0,
        gid: int = 0,
        mtime: int = T0,
        xattrs: dict[str, bytes] | None = None,
    ) -> Layer:
        p = self._path(rel)
        p.write_bytes(data)
        os.chown(p, uid, gid)
        p.chmod(mode)
        for k, v in (xattrs or {}).items():
            os.setxattr(p, k, v)
        os.utime(p, ns=(mtime * 10**9, mtime * 10**9 + 123))
        return self

    def symlink(self, rel: str, target: str, uid: int = 0, mtime: int = T0) -> Layer:
        p = self._path(rel)
        p.symlink_to(target)
        os.lchown(p, uid, uid)
        os.utime(p, (mtime, mtime), follow_symlinks=False)
        return self

    def whiteout(self, rel: str) -> Layer:
        os.mknod(self._path(rel), stat.S_IFCHR, os.makedev(0, 0))
        return self

    def node(self, rel: str, kind: int, mode: int = 0o640) -> Layer:
        p = self._path(rel)
        os.mknod(p, kind | mode)
        os.chmod(p, mode)
        os.utime(p, (T0, T0))
        return self

    def hardlink(self, rel: str, existing: str) -> Layer:
        os.link(self.root / existing, self._path(rel), follow_symlinks=False)
        return self

    def seal(self) -> Path:
        for d in sorted(
            (p for p in walk(self.root) if stat.S_ISDIR(os.lstat(p).st_mode)),
            key=lambda p: len(p.parts),
            reverse=True,
        ):
            t = self.dir_times.get(str(d.relative_to(self.root)), T0)
            os.utime(d, ns=(t * 10**9, t * 10**9 + 7))
        t = self.dir_times.get("", T0)
        os.utime(self.root, ns=(t * 10**9, t * 10**9))
        return self.root


# --- observing overlay views ---
@contextlib.contextmanager
def overlay(lowers: list[Path], target: Path) -> Iterator[Path]:
    """A read-only overlay of `lowers` (topmost first) at target; unmounted on exit."""
    target.mkdir(parents=True, exist_ok=True)
    opts = "ro,lowerdir=" + ":".join(str(p) for p in lowers)
    subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", opts, str(target)],
        check=True,
        capture_output=True,
    )
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=False, capture_output=True)


def _xattrs(p: str) -> tuple[tuple[str, bytes], ...]:
    names = os.listxattr(p, follow_symlinks=False)
    return tuple(sorted((n, os.getxattr(p, n, follow_symlinks=False)) for n in names))


def _describe(p: str, st: os.stat_result) -> tuple[Any, ...]:
    """What a reader of the view can observe about one entry.

    Compared: type, permission bits, owner, the xattrs overlayfs lists (it hides its own
    trusted.overlay.*), mtimes in ns (directories included: the merged layer copies them from
    the topmost directory), size and content of files, symlink targets, device numbers.
    Not compared: st_ino/st_dev (per mount; and a copied file is another inode — hard links
    are compared as groups instead), st_nlink (overlayfs reports 1 for a merged directory
    and the real count otherwise; linking into the merged layer raises the real count),
    directory st_size (ext4's depends on the directory's history), atime (reading changes
    it), ctime (link(2) changes it; merged directories are new inodes)."""
    kind = stat.S_IFMT(st.st_mode)
    head = (kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, _xattrs(p), st.st_mtime_ns)
    if kind == stat.S_IFREG:
        return (*head, st.st_size, Path(p).read_bytes())
    if kind == stat.S_IFLNK:
        return (*head, os.readlink(p))
    if kind in (stat.S_IFCHR, stat.S_IFBLK):
        return (*head, st.st_rdev)
    return head


def view(root: Path) -> tuple[dict[str, tuple[Any, ...]], set[str]]:
    """Every entry of a mounted view (relative path -> `_describe` + hard-link group), and
    its "ghosts": names readdir lists but lstat cannot find (whiteouts overlayfs did not
    filter, see test_origin_marker_filters_whiteouts_in_single_layer_dirs)."""
    out: dict[str, tuple[Any, ...]] = {".": _describe(str(root), os.lstat(root))}
    ghosts: set[str] = set()
    inodes: dict[int, list[str]] = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        for name in sorted(os.listdir(os.path.join(root, rel))):
            child = f"{rel}/{name}" if rel else name
            p = os.path.join(root, child)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                ghosts.add(child)
                continue
            out[child] = _describe(p, st)
            if stat.S_ISDIR(st.st_mode):
                stack.append(child)
            else:
                inodes.setdefault(st.st_ino, []).append(child)
    for group in inodes.values():
        if len(group) > 1:
            for rel in group:
                out[rel] = (*out[rel], ("links", tuple(sorted(group))))
    return out, ghosts


def assert_same_view(run: list[Path], merged: Path, base: Path, scratch: Path) -> set[str]:
    """Mounts run+base and merged+base and compares them; returns the ghosts the original
    stack showed and the merged one does not (squashing may filter them, never add any)."""
    scratch.mkdir(parents=True, exist_ok=True)
    with (
        overlay([*run, base], scratch / "orig") as a,
        overlay([merged, base], scratch / "new") as b,
    ):
        return compare_views(a, b)


def compare_views(original: Path, merged: Path) -> set[str]:
    want, want_ghosts = view(original)
    got, got_ghosts = view(merged)
    diff = [
        (rel, want.get(rel), got.get(rel))
        for rel in sorted(set(want) | set(got))
        if want.get(rel) != got.get(rel)
    ]
    assert not diff, "views differ (path, original, merged):\n" + "\n".join(map(repr, diff))
    assert got_ghosts <= want_ghosts, got_ghosts - want_ghosts
    return want_ghosts - got_ghosts


def raw(root: Path) -> dict[str, tuple[Any, ...]]:
    """A layer directory as stored, overlay xattrs included (for "untouched" checks)."""
    out: dict[str, tuple[Any, ...]] = {}
    for p in [root, *walk(root)]:
        st = os.lstat(p)
        out[str(p.relative_to(root))] = (*_describe(str(p), st), st.st_ino)
    return out


def is_whiteout(p: Path) -> bool:
    st = os.lstat(p)
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def has_xattr(p: Path, name: str) -> bool:
    return name in os.listxattr(p, follow_symlinks=False)


# --- the hand-built stack ---
def build_stack(root: Path) -> tuple[list[Path], Path]:
    """A base layer and a run of three layers above it (topmost first), covering the cases
    the squash must get right."""
    base = Layer(root / "base")
    base.dir("", mode=0o755, mtime=T0 - 100)
    base.file("etc/passwd", b"base").file("etc/only_base", b"ob").file("etc/keep", b"k")
    base.file("opt/old/f1", b"f1")
    base.file("var/lib/keep", b"vk")
    base.file("srv/a/x", b"x")
    base.file("home/u/.profile", b"u")
    base.file("data", b"a file below the run")
    base.dir("share", mode=0o755).file("share/doc/base", b"bd")

    l3 = Layer(root / "l3")
    l3.dir("etc", mode=0o755, mtime=T0 + 30, xattrs={"user.tag": b"l3"})
    l3.file("etc/passwd", b"l3", xattrs={"user.v": b"3"})
    l3.file("etc/added_l3", b"a3").file("etc/gone_in_run", b"g")
    l3.file("opt/old/f2", b"f2")  # opt/old: a plain dir in l3, deleted by l2
    l3.file("tmpdir/a", b"a").file("tmpdir/sub/b", b"b")  # a dir, replaced by a file in l2
    l3.file("ftod", b"file, a dir in l1")
    l3.file("hl/a", b"shared", mode=0o755).hardlink("hl/b", "hl/a")
    l3.symlink("sl", "etc/passwd", uid=7)
    l3.node("pipe", stat.S_IFIFO, 0o640).node("sock", stat.S_IFSOCK, 0o755)
    l3.file("data/inner", b"a dir over the file below")
    l3.dir("share", mode=0o700, uid=1000, gid=1000, mtime=T0 + 3).file("share/doc/l3", b"x")
    l3.file("newdir/x", b"x").file("newdir/y", b"y")  # newdir: not below the run

    l2 = Layer(root / "l2")
    l2.dir("", opaque=True)  # overlayfs ignores it on a layer's root: so must the squash
    l2.whiteout("opt/old")
    l2.file("tmpdir", b"now a file")
    l2.file("etc/passwd", b"l2", mode=0o600, xattrs={"user.v": b"2"})
    l2.symlink("sl", "etc/added_l3")
    l2.dir("share", mode=0o750, uid=1001, gid=1001, mtime=T0 + 2, xattrs={"user.d": b"l2"})
    l2.dir("newdir").whiteout("newdir/x")  # a whiteout of an entry inside the run only
    l2.dir("cache", opaque=True).file("cache/new", b"n").whiteout("cache/old")

    l1 = Layer(root / "l1")
    l1.dir("", mode=0o751, mtime=T0 + 1000)
    l1.file("opt/old/new", b"new")  # re-created, as a plain dir: the squash makes it opaque
    l1.dir("var", opaque=True).file("var/new", b"vn")  # explicitly opaque
    # Two whiteouts sharing one inode, as the kernel makes them in an upper.
    l1.whiteout("etc/gone_in_run").hardlink("etc/only_base", "etc/gone_in_run")
    l1.dir("etc", mode=0o711, mtime=T0 + 11, xattrs={"user.tag": b"l1"})
    l1.file("etc/added_top", b"t", mode=0o600, uid=5, gid=6, xattrs={"user.a": b"1"})
    l1.file("ftod/c", b"c")  # a file in l3 replaced by a dir
    l1.file("srv", b"a dir below the run replaced by a file")
    l1.whiteout("home")  # a dir that exists below the run only
    l1.file("hl/c", b"c").hardlink("hl/d", "hl/c").file("hl/a", b"new a")
    l1.dir("share", mode=0o755, uid=1002, gid=1003, mtime=T0 + 1, xattrs={"user.d": b"l1"})
    l1.node("share/fifo", stat.S_IFIFO)

    return [l1.seal(), l2.seal(), l3.seal()], base.seal()


def assert_plain_tree_is_view(run: list[Path], merged: Path, scratch: Path) -> None:
    """A `bottom` merge is a plain tree showing what the whole stack showed."""
    for p in walk(merged):
        assert not is_whiteout(p), p
        assert not any(n.startswith("trusted.") for n in os.listxattr(p, follow_symlinks=False))
    if len(run) == 1:  # overlayfs wants two lower layers at least when it has no upper
        empty = scratch / "empty"
        empty.mkdir(parents=True)
        run = [*run, empty]
    with overlay(run, scratch / "orig") as a:
        compare_views(a, merged)
