"""The changes of an overlay upper since a copy of it (images/diffcopy.py): what goes in the
layer, and (as root, with real overlay mounts) that the stack shows what the upper shows."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.images.diffcopy import OPAQUE, copy_changes


def tree(root: Path) -> dict[str, tuple[str, int, str]]:
    """path -> (type, mode, content or link target) of everything under root."""
    out: dict[str, tuple[str, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", 0, os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode), "")
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", stat.S_IMODE(st.st_mode), p.read_text())
            else:
                out[rel] = ("other", st.st_rdev, "")
    return out


def snapshot_copy(upper: Path, dst: Path) -> None:
    subprocess.run(["cp", "-a", str(upper), str(dst)], check=True)


@pytest.fixture
def upper(tmp_path: Path) -> Path:
    u = tmp_path / "upper"
    (u / "keep" / "deep").mkdir(parents=True)
    (u / "keep" / "same.txt").write_text("same")
    (u / "keep" / "deep" / "edit.txt").write_text("before")
    (u / "gone-dir" / "x").mkdir(parents=True)
    (u / "gone.txt").write_text("bye")
    os.symlink("keep/same.txt", u / "link")
    return u


def test_nothing_changed_gives_an_empty_layer(upper: Path, tmp_path: Path) -> None:
    snapshot_copy(upper, tmp_path / "base")
    assert copy_changes(upper, [tmp_path / "base"], tmp_path / "d") == 0
    assert list((tmp_path / "d").iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts are device nodes: root only")
def test_only_changes_and_whiteouts_go_in(upper: Path, tmp_path: Path) -> None:
    base = tmp_path / "base"
    snapshot_copy(upper, base)
    (upper / "keep" / "deep" / "edit.txt").write_text("after, longer")
    (upper / "new" / "sub").mkdir(parents=True)
    (upper / "new" / "sub" / "f").write_text("new")
    (upper / "gone.txt").unlink()
    subprocess.run(["rm", "-r", str(upper / "gone-dir")], check=True)
    os.unlink(upper / "link")
    os.symlink("keep/deep/edit.txt", upper / "link")
    d = tmp_path / "d"
    assert copy_changes(upper, [base], d) > 0
    got = tree(d)
    assert got["keep/deep/edit.txt"][2] == "after, longer"
    assert "keep/same.txt" not in got  # unchanged: stays in the base layer
    assert got["new/sub/f"][2] == "new"
    assert got["link"] == ("link", 0, "keep/deep/edit.txt")
    for gone in ("gone.txt", "gone-dir"):
        st = os.lstat(d / gone)
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(0, 0)


@contextlib.contextmanager
def overlay(tmp_path: Path, name: str, lowers: list[Path]) -> Iterator[Path]:
    target = tmp_path / name
    target.mkdir()
    opts = "ro,lowerdir=" + ":".join(str(p) for p in lowers)
    r = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", opts, str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(f"no overlay mounts here: {r.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="overlay mounts: root only")
def test_the_stack_shows_what_the_upper_shows(upper: Path, tmp_path: Path) -> None:
    lower = tmp_path / "lower"
    (lower / "etc").mkdir(parents=True)
    (lower / "etc" / "os").write_text("debian")
    (lower / "opaque-me").mkdir()
    (lower / "opaque-me" / "old").write_text("from the image")
    base = tmp_path / "base"
    snapshot_copy(upper, base)
    # After the first copy: edits, a delete of an image file (a whiteout in the upper), a
    # directory replaced (opaque in the upper), a chmod of a directory.
    (upper / "keep" / "deep" / "edit.txt").write_text("edited")
    (upper / "etc").mkdir()
    _whiteout_in(upper / "etc" / "os")
    (upper / "opaque-me").mkdir()
    os.setxattr(upper / "opaque-me", OPAQUE, b"y")
    (upper / "opaque-me" / "fresh").write_text("only this")
    (upper / "gone.txt").unlink()
    os.chmod(upper / "keep", 0o700)
    d = tmp_path / "d"
    copy_changes(upper, [base], d)
    with (
        overlay(tmp_path, "want", [upper, lower]) as want,
        overlay(tmp_path, "got", [d, base, lower]) as got,
    ):
        assert tree(got) == tree(want)
        assert not (got / "etc" / "os").exists()
        assert os.listdir(got / "opaque-me") == ["fresh"]


def _whiteout_in(path: Path) -> None:
    os.mknod(path, stat.S_IFCHR, os.makedev(0, 0))


@pytest.mark.skipif(os.geteuid() != 0, reason="overlay mounts: root only")
def test_rounds_of_changes_stack_up_to_the_upper(upper: Path, tmp_path: Path) -> None:
    lower = tmp_path / "lower"
    (lower / "img").mkdir(parents=True)
    (lower / "img" / "a").write_text("image")
    copies = [tmp_path / "c0"]
    snapshot_copy(upper, copies[0])
    rounds = [
        lambda: (upper / "keep" / "same.txt").write_text("round 1"),
        lambda: subprocess.run(["rm", "-r", str(upper / "keep" / "deep")], check=True),
        lambda: (upper / "keep" / "deep").mkdir(),  # back, empty: the old files stay gone
        lambda: (upper / "gone.txt").write_text("back again"),
        lambda: _whiteout_in(upper / "img"),  # the image's directory deleted
    ]
    for i, change in enumerate(rounds, 1):
        change()
        d = tmp_path / f"c{i}"
        copy_changes(upper, copies, d)
        copies.insert(0, d)
        with (
            overlay(tmp_path, f"want{i}", [upper, lower]) as want,
            overlay(tmp_path, f"got{i}", [*copies, lower]) as got,
        ):
            assert tree(got) == tree(want), f"round {i}"
    assert copy_changes(upper, copies, tmp_path / "none") == 0
