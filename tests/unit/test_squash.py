"""Squashing a run of overlay layers into one: the merged layer, stacked in place of the run,
must give the same overlay view. The kernel is the oracle: both stacks are mounted. These cover
the hand-built stack (tests/unit/overlay_layers.py), what is never followed or refused, and
squashing into the layer store (deterministic, idempotent, concurrent).
"""

from __future__ import annotations

import errno
import os
import random
import stat
import threading
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
from tests.unit.overlay_layers import (
    T0,
    Layer,
    _xattrs,
    assert_plain_tree_is_view,
    assert_same_view,
    build_stack,
    has_xattr,
    is_whiteout,
    overlay,
    raw,
    walk,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="overlay mounts and whiteouts need root")


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
