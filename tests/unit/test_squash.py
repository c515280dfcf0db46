"""Squashing a run of overlay layers into one: the merged layer, stacked in place of the run,
must give the same overlay view. The kernel is the oracle: both stacks are mounted."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import stat
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aenv.config import Settings
from aenv.errors import NotFound
from aenv.images import squash as squash_mod
from aenv.images.layers import LayerStore, tree_digest
from aenv.images.squash import (
    ORIGIN_XATTR,
    SquashError,
    SquashStats,
    merge_layers,
    squash_digest,
    squash_into_store,
)
from aenv.images.unpack import OPAQUE_XATTR

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="overlay mounts and whiteouts need root")

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


def test_merged_layer_gives_the_same_view(tmp_path: Path) -> None:
    run, base = build_stack(tmp_path / "layers")
    before = [(tree_digest(p)[0], raw(p)) for p in run]
    merged = tmp_path / "merged"
    stats = merge_layers(run, merged)

    assert_same_view(run, merged, base, tmp_path / "mnt")
    # ... and with nothing below the run.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_same_view(run, merged, empty, tmp_path / "mnt2")

    # Opaque exactly where the run's stack ends inside the run.
    for rel in ("opt/old", "var", "ftod", "cache"):
        assert os.getxattr(merged / rel, OPAQUE_XATTR) == b"y", rel
    for rel in ("", "etc", "share", "newdir", "data", "hl", "opt"):
        assert not has_xattr(merged / rel, OPAQUE_XATTR), rel
    # Whiteouts kept (for what is below the run), but not inside opaque dirs.
    for rel in ("etc/only_base", "etc/gone_in_run", "home", "newdir/x"):
        assert is_whiteout(merged / rel), rel
    assert not os.path.lexists(merged / "cache/old")
    # The one non-opaque dir holding whiteouts carries the marker; no other overlay xattr.
    assert os.getxattr(merged / "newdir", ORIGIN_XATTR) == b""
    assert os.getxattr(merged / "etc", ORIGIN_XATTR) == b""
    for p in [merged, *walk(merged)]:
        extra = {n for n in os.listxattr(p, follow_symlinks=False) if n.startswith("trusted.")}
        assert extra <= {OPAQUE_XATTR, ORIGIN_XATTR}, (p, extra)
    # Hard links to the layers' inodes: no data copied, in-layer hard links kept.
    assert os.lstat(merged / "hl/c").st_ino == os.lstat(run[0] / "hl/c").st_ino
    assert os.lstat(merged / "hl/d").st_ino == os.lstat(merged / "hl/c").st_ino
    assert os.lstat(merged / "hl/b").st_ino == os.lstat(run[2] / "hl/a").st_ino
    assert os.lstat(merged / "sl").st_ino == os.lstat(run[1] / "sl").st_ino
    # Directory attributes from the topmost directory.
    st = os.lstat(merged / "share")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o755, 1002, 1003)
    assert st.st_mtime_ns == (T0 + 1) * 10**9 + 7
    assert os.getxattr(merged / "share", "user.d") == b"l1"
    assert stat.S_IMODE(os.lstat(merged).st_mode) == 0o751

    assert stats == SquashStats(
        layers=3,
        dirs=stats.dirs,
        opaque_dirs=4,
        files=stats.files,
        size=stats.size,
        symlinks=1,
        whiteouts=4,
        others=3,
        copied=0,
        dropped_whiteouts=1,
    )
    assert stats.files == len([p for p in walk(merged) if stat.S_ISREG(os.lstat(p).st_mode)])
    # The inputs are untouched (link counts and ctimes aside).
    assert [(tree_digest(p)[0], raw(p)) for p in run] == before
    # The same inputs merge to the same content (what squash_digest relies on).
    again = tmp_path / "again"
    merge_layers(run, again)
    assert tree_digest(again) == tree_digest(merged)
    assert [_xattrs(str(p)) for p in walk(again)] == [_xattrs(str(p)) for p in walk(merged)]


def test_bottom_merge_is_a_plain_tree(tmp_path: Path) -> None:
    run, base = build_stack(tmp_path / "layers")
    whole = tmp_path / "whole"
    stats = merge_layers([*run, base], whole, bottom=True)
    assert stats.whiteouts == stats.opaque_dirs == 0 and stats.dropped_whiteouts == 5
    assert not os.path.lexists(whole / "home") and not os.path.lexists(whole / "etc/only_base")
    assert sorted(os.listdir(whole / "opt/old")) == ["new"]
    assert_plain_tree_is_view([*run, base], whole, tmp_path / "mnt")
    # One layer alone is cleaned too (its whiteouts and opaque flags dropped).
    single = tmp_path / "single"
    merge_layers(run[:1], single, bottom=True)
    assert_plain_tree_is_view(run[:1], single, tmp_path / "mnt1")


def test_origin_marker_filters_whiteouts_in_single_layer_dirs(tmp_path: Path) -> None:
    """overlayfs filters whiteouts out of readdir only in directories merged from several
    layers or carrying an origin xattr. Squashed, `d` is one layer's directory (nothing below
    the run has it): without the marker its whiteout would be listed (a ghost)."""
    run = [
        Layer(tmp_path / "l1").dir("d").whiteout("d/x").file("d/y", b"y").seal(),
        Layer(tmp_path / "l2").file("d/x", b"x").seal(),
    ]
    base = Layer(tmp_path / "base").file("other", b"o").seal()
    merged = tmp_path / "merged"
    merge_layers(run, merged)
    assert_same_view(run, merged, base, tmp_path / "mnt")
    with overlay([merged, base], tmp_path / "mnt/check") as m:
        assert os.listdir(m / "d") == ["y"]

    os.removexattr(merged / "d", ORIGIN_XATTR)
    with overlay([merged, base], tmp_path / "mnt/bare") as m:
        assert sorted(os.listdir(m / "d")) == ["x", "y"]  # the kernel behaviour worked around
        assert not os.path.lexists(m / "d/x")


def test_links_that_fail_become_copies_and_stay_linked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EMLINK (an inode at the filesystem's link limit) or EXDEV: the entry is copied with
    its metadata, and the other paths linked to the same inode follow the copy."""
    run, base = build_stack(tmp_path / "layers")
    real = squash_mod._hardlink
    rng = random.Random(7)
    failed: list[str] = []

    def flaky(src: str, name: str, dir_fd: int, *, src_dir_fd: int | None = None) -> None:
        if src_dir_fd is None and rng.random() < 0.5:
            failed.append(src)
            raise OSError(errno.EMLINK, "Too many links")
        real(src, name, dir_fd, src_dir_fd=src_dir_fd)

    monkeypatch.setattr(squash_mod, "_hardlink", flaky)
    merged = tmp_path / "merged"
    stats = merge_layers(run, merged)
    assert stats.copied == len(failed) > 0
    assert_same_view(run, merged, base, tmp_path / "mnt")

    # Every link failing: a full copy, hard links still grouped.
    monkeypatch.setattr(squash_mod, "_hardlink", lambda *a, **k: _raise(errno.EXDEV))
    copied = tmp_path / "copied"
    stats = merge_layers(run, copied)
    assert stats.copied == stats.files + stats.symlinks + stats.whiteouts + stats.others
    assert os.lstat(copied / "hl/c").st_ino != os.lstat(run[0] / "hl/c").st_ino
    assert os.lstat(copied / "hl/d").st_ino == os.lstat(copied / "hl/c").st_ino
    assert_same_view(run, copied, base, tmp_path / "mnt2")


def _raise(code: int) -> None:
    raise OSError(code, os.strerror(code))


# --- randomized stacks ---
NAMES = ("a", "b", "c")
OPS = ("file", "dir", "opaque", "whiteout", "symlink", "fifo", "hardlink")
WEIGHTS = (6, 3, 1, 3, 1, 1, 1)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif os.path.lexists(p):
        p.unlink()


def random_layer(rng: random.Random, root: Path, ops: int) -> Path:
    """A layer of random entries over a small namespace (so layers overlap a lot)."""
    root.mkdir(parents=True)
    for _ in range(ops):
        parts = [rng.choice(NAMES) for _ in range(rng.randint(1, 3))]
        cur = root
        for part in parts[:-1]:
            cur = cur / part
            if os.path.lexists(cur) and not (cur.is_dir() and not cur.is_symlink()):
                cur.unlink()
            cur.mkdir(exist_ok=True)
        p = cur / parts[-1]
        _remove(p)
        op = rng.choices(OPS, WEIGHTS)[0]
        if op == "hardlink":
            others = [q for q in walk(root) if stat.S_ISREG(os.lstat(q).st_mode)]
            if others:
                os.link(rng.choice(others), p)
                continue
            op = "file"
        if op == "file":
            p.write_bytes(rng.randbytes(rng.randint(0, 24)))
            p.chmod(rng.choice((0o644, 0o600, 0o755, 0o4755)))
            if rng.random() < 0.3:
                os.setxattr(p, "user.k", rng.randbytes(3))
        elif op in ("dir", "opaque"):
            p.mkdir()
            if op == "opaque":
                os.setxattr(p, OPAQUE_XATTR, b"y")
        elif op == "whiteout":
            os.mknod(p, stat.S_IFCHR, os.makedev(0, 0))
        elif op == "symlink":
            p.symlink_to(rng.choice(("a", "../b/c", "/etc/passwd", "c/missing")))
        elif op == "fifo":
            os.mkfifo(p, 0o640)
    if rng.random() < 0.2:
        os.setxattr(root, OPAQUE_XATTR, b"y")  # ignored by overlayfs on a layer's root
    # Metadata last: owners, modes, xattrs and times, directories after their content.
    entries = sorted(walk(root), key=lambda q: len(q.parts), reverse=True)
    for q in [*entries, root]:
        uid = rng.choice((0, 1000))
        os.lchown(q, uid, rng.choice((0, uid)))
        if q.is_dir() and not q.is_symlink():
            q.chmod(rng.choice((0o755, 0o700, 0o750, 0o1777, 0o2775)))
            if rng.random() < 0.3:
                os.setxattr(q, "user.d", rng.randbytes(2))
        t = rng.randint(T0, T0 + 10**6) * 10**9 + rng.randint(0, 10**9 - 1)
        os.utime(q, ns=(t, t), follow_symlinks=False)
    return root


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


@pytest.mark.parametrize("seed", range(20))
def test_random_stacks(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    base = random_layer(rng, tmp_path / "base", rng.randint(5, 15))
    run = [
        random_layer(rng, tmp_path / f"l{i}", rng.randint(3, 15)) for i in range(rng.randint(2, 4))
    ]
    before = [raw(p) for p in run]
    merged = tmp_path / "merged"
    merge_layers(run, merged)
    assert_same_view(run, merged, base, tmp_path / "mnt")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_same_view(run, merged, empty, tmp_path / "mnt2")
    whole = tmp_path / "whole"
    merge_layers([*run, base], whole, bottom=True)
    assert_plain_tree_is_view([*run, base], whole, tmp_path / "mnt3")
    assert [raw(p) for p in run] == before


# --- safety ---
def test_symlinks_are_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    # A symlink in a lower layer of the run, a directory of the same name above it.
    run = [
        Layer(tmp_path / "l1").file("a/f", b"f").seal(),
        Layer(tmp_path / "l2").symlink("a", str(outside)).seal(),
    ]
    merged = tmp_path / "merged"
    merge_layers(run, merged)
    assert os.listdir(outside) == []
    assert (merged / "a").is_dir() and not (merged / "a").is_symlink()
    assert os.getxattr(merged / "a", OPAQUE_XATTR) == b"y"

    link = tmp_path / "linked-layer"
    link.symlink_to(run[0])
    with pytest.raises(SquashError, match="not a directory"):
        merge_layers([link, run[1]], tmp_path / "m2")
    assert not os.path.lexists(tmp_path / "m2")
    with pytest.raises(SquashError, match="exists"):
        merge_layers(run, merged)
    with pytest.raises(SquashError, match="does not exist"):
        merge_layers([tmp_path / "nope"], tmp_path / "m3")


def test_unsupported_overlay_metadata_is_refused(tmp_path: Path) -> None:
    run = [
        Layer(tmp_path / "l1").dir("d").seal(),
        Layer(tmp_path / "l2").file("d/x", b"x").seal(),
    ]
    os.setxattr(run[0] / "d", "trusted.overlay.redirect", b"/elsewhere")
    with pytest.raises(SquashError, match="redirect"):
        merge_layers(run, tmp_path / "m")
    assert not os.path.lexists(tmp_path / "m")  # a failed merge leaves nothing behind
    os.removexattr(run[0] / "d", "trusted.overlay.redirect")
    os.setxattr(run[0] / "d", OPAQUE_XATTR, b"x")
    with pytest.raises(SquashError, match="xattr whiteouts"):
        merge_layers(run, tmp_path / "m")


# --- the store ---
@pytest.fixture
def store(tmp_path: Path) -> LayerStore:
    return LayerStore(Settings(home=tmp_path / "home"))


def add_stack(store: LayerStore, tmp_path: Path) -> tuple[list[str], str]:
    run, base = build_stack(tmp_path / "src")
    digests = [store.add_dir(p, source="test") for p in run]
    return digests, store.add_dir(base, source="test")


def test_squash_into_store_is_deterministic_and_idempotent(
    store: LayerStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    digests, base = add_stack(store, tmp_path)
    before = [tree_digest(store.path(d))[0] for d in digests]

    digest = squash_into_store(store, digests, "squash test")
    assert digest == squash_digest(digests) != squash_digest(list(reversed(digests)))
    assert digest == squash_digest(list(digests))  # a function of the ordered inputs only
    assert store.has(digest)
    info = store.info(digest)
    assert info.source == "squash test"
    meta = (store.layer_dir(digest) / "meta.json").read_text()
    assert all(d in meta for d in digests)
    assert [tree_digest(store.path(d))[0] for d in digests] == before
    assert list(store.tmp.iterdir()) == []
    assert_same_view(
        [store.path(d) for d in digests], store.path(digest), store.path(base), tmp_path / "mnt"
    )

    # A whole stack squashes into a plain tree, under a digest of its own.
    whole = squash_into_store(store, [*digests, base], bottom=True)
    assert whole == squash_digest([*digests, base], bottom=True)
    assert whole != squash_digest([*digests, base])
    assert not os.path.lexists(store.path(whole) / "home")

    # Known already: no work at all.
    def boom(*_: object, **__: object) -> SquashStats:
        raise AssertionError("merged again")

    monkeypatch.setattr(squash_mod, "merge_layers", boom)
    assert squash_into_store(store, digests, "again") == digest
    assert squash_into_store(store, [*digests, base], bottom=True) == whole
    assert store.info(digest).source == "squash test"
    # A single layer is its own squash.
    assert squash_into_store(store, digests[:1]) == digests[0]
    with pytest.raises(NotFound):
        squash_into_store(store, [digests[0], "sha256:" + "0" * 64])


def test_concurrent_squashes_of_the_same_run(
    store: LayerStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    digests, _ = add_stack(store, tmp_path)
    real = squash_mod.merge_layers
    both_built = threading.Barrier(2, timeout=30)

    def slow_merge(layers: list[Path], dest: Path, **kw: Any) -> SquashStats:
        stats = real(layers, dest, **kw)
        both_built.wait()  # both threads have built their copy before either publishes
        return stats

    monkeypatch.setattr(squash_mod, "merge_layers", slow_merge)
    results: list[str] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(squash_into_store(store, digests, "race"))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results == [squash_digest(digests)] * 2
    assert list(store.tmp.iterdir()) == []
    assert [i.digest for i in store.list()].count(results[0]) == 1
    assert (store.path(results[0]) / "etc/added_top").read_bytes() == b"t"
