"""Trees and checkpoints for the snapshot repository's and store's contract tests: a tree of
files, links and modes made on disk, a fake checkpoint, and the comparison of two trees (the
same files, modes and times).
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from aenv.images.layers import tree_digest

IS_ROOT = os.geteuid() == 0
MTIME = 1_700_000_000


# --------------------------------------------------------------------------- helpers
def make_tree(root: Path, tag: str, *, big: int = 200_000) -> Path:
    """A rootfs-like tree with modes, owners, symlinks, hard links, xattrs, a whiteout."""
    (root / "etc").mkdir(parents=True)
    (root / "etc/hostname").write_text(f"{tag}\n")
    (root / "etc/secret").write_bytes(b"s" * 10)
    (root / "etc/secret").chmod(0o600)
    (root / "bin").mkdir()
    (root / "bin/tool").write_bytes(tag.encode() + os.urandom(big))
    (root / "bin/tool").chmod(0o4755)  # setuid survives
    (root / "bin/alias").symlink_to("tool")
    (root / "bin/dangling").symlink_to("/nonexistent/target")
    os.link(root / "bin/tool", root / "bin/tool-hardlink")
    (root / "tmp").mkdir()
    (root / "tmp").chmod(0o1777)
    (root / "empty").mkdir()
    os.setxattr(root / "etc/hostname", "user.aenv", b"kept")
    if IS_ROOT:
        os.chown(root / "etc/secret", 1234, 5678)
        os.chown(root / "bin/alias", 42, 43, follow_symlinks=False)
        os.mknod(root / "etc/removed", stat.S_IFCHR | 0o000, os.makedev(0, 0))  # whiteout
        os.setxattr(root / "empty", "trusted.overlay.opaque", b"y")
    for p in [*root.rglob("*"), root]:
        os.utime(p, (MTIME, MTIME), follow_symlinks=False)
    return root


def sha256_file(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def make_checkpoint(d: Path, seed: str, size: int = 300_000) -> Path:
    d.mkdir(parents=True)
    (d / "checkpoint.img").write_bytes(seed.encode() * 1000)
    (d / "pages_meta.img").write_bytes(b"meta-" + seed.encode())
    # pages.img-like: random and zero pages
    (d / "pages.img").write_bytes(os.urandom(size // 2) + bytes(size // 2))
    return d


def empty(d: Path) -> bool:
    """True if the directory is missing or has nothing in it."""
    return not d.exists() or not os.listdir(d)


def assert_same_tree(a: Path, b: Path) -> None:
    assert tree_digest(a) == tree_digest(b)
    ta, tb = (b / "bin/tool").stat(), (b / "bin/tool-hardlink").stat()
    assert ta.st_ino == tb.st_ino, "hard link not preserved"
    assert os.readlink(b / "bin/alias") == "tool"
    assert os.readlink(b / "bin/dangling") == "/nonexistent/target"
    assert stat.S_IMODE((b / "bin/tool").stat().st_mode) == 0o4755
    assert stat.S_IMODE((b / "tmp").stat().st_mode) == 0o1777
    assert os.getxattr(b / "etc/hostname", "user.aenv") == b"kept"
    if IS_ROOT:
        assert (b / "etc/secret").stat().st_uid == 1234
        assert (b / "etc/secret").stat().st_gid == 5678
        assert os.lstat(b / "bin/alias").st_uid == 42
        st = os.lstat(b / "etc/removed")
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(0, 0)
        assert os.getxattr(b / "empty", "trusted.overlay.opaque") == b"y"
