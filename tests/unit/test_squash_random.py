"""Squashing randomized stacks of overlay layers (files, directories, opaque directories,
whiteouts, symlinks, fifos, hard links): the merged layer, stacked in place of the run, must
give the same overlay view as the run, with both stacks mounted (tests/unit/overlay_layers.py).
"""

from __future__ import annotations

import os
import random
import shutil
import stat
from pathlib import Path

import pytest

from aenv.images.squash import merge_layers
from aenv.images.unpack import OPAQUE_XATTR
from tests.unit.overlay_layers import T0, assert_plain_tree_is_view, assert_same_view, raw, walk

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="overlay mounts and whiteouts need root")


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
