"""The content-addressed layer store: digests, atomic adds, removal."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.errors import BadRequest, NotFound
from aenv.images import layers as layers_mod
from aenv.images.layers import LayerStore, tree_digest


def make_tree(root: Path, content: bytes = b"hello\n") -> Path:
    (root / "etc").mkdir(parents=True)
    (root / "etc/hostname").write_bytes(content)
    (root / "bin").mkdir()
    (root / "bin/tool").write_bytes(b"\x7fELF" + b"\0" * 5000)
    (root / "bin/tool").chmod(0o755)
    (root / "bin/alias").symlink_to("tool")
    (root / "empty").mkdir()
    for p in root.rglob("*"):
        os.utime(p, (1_700_000_000, 1_700_000_000), follow_symlinks=False)
    return root


@pytest.fixture
def store(tmp_path: Path) -> LayerStore:
    return LayerStore(Settings(home=tmp_path / "home"))


def test_digest_is_stable_and_content_sensitive(tmp_path: Path) -> None:
    a = make_tree(tmp_path / "a")
    d1, size, entries = tree_digest(a)
    assert d1.startswith("sha256:") and len(d1) == 7 + 64
    assert tree_digest(a)[0] == d1
    assert size == len(b"hello\n") + 5004
    assert entries == 6

    # A copy preserving metadata hashes the same; directory mtimes do not matter.
    b = tmp_path / "b"
    subprocess.run(["cp", "-a", str(a), str(b)], check=True)
    os.utime(b / "etc", (1, 1))
    assert tree_digest(b)[0] == d1

    (b / "etc/hostname").write_bytes(b"hellO\n")
    os.utime(b / "etc/hostname", (1_700_000_000, 1_700_000_000))
    assert tree_digest(b)[0] != d1

    c = tmp_path / "c"
    subprocess.run(["cp", "-a", str(a), str(c)], check=True)
    (c / "bin/tool").chmod(0o700)
    assert tree_digest(c)[0] != d1

    d = tmp_path / "d"
    subprocess.run(["cp", "-a", str(a), str(d)], check=True)
    (d / "bin/alias").unlink()
    (d / "bin/alias").symlink_to("other")
    assert tree_digest(d)[0] != d1


def test_add_move_and_read_back(store: LayerStore, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    expected = tree_digest(src)[0]
    digest = store.add_dir(src, source="test")
    assert digest == expected
    assert not src.exists()  # moved
    assert store.has(digest)
    root = store.path(digest)
    assert root == store.root / f"sha256-{digest.split(':')[1]}" / "rootfs"
    assert (root / "etc/hostname").read_bytes() == b"hello\n"
    assert os.readlink(root / "bin/alias") == "tool"
    info = store.info(digest)
    assert info.size == store.size(digest) == 6 + 5004
    assert info.source == "test"
    assert [i.digest for i in store.list()] == [digest]
    # Nothing left in staging.
    assert list(store.tmp.iterdir()) == []


def test_add_same_content_twice_keeps_one(store: LayerStore, tmp_path: Path) -> None:
    d1 = store.add_dir(make_tree(tmp_path / "one"))
    again = make_tree(tmp_path / "two")
    d2 = store.add_dir(again)
    assert d1 == d2
    assert not again.exists()
    assert len(store.list()) == 1


def test_add_copy_and_link_keep_source(store: LayerStore, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    d = store.add_dir(src, mode="link")
    assert src.is_dir()
    assert (store.path(d) / "bin/tool").stat().st_ino == (src / "bin/tool").stat().st_ino
    store.remove(d)
    d2 = store.add_dir(src, mode="copy")
    assert d2 == d
    assert (store.path(d) / "bin/tool").stat().st_ino != (src / "bin/tool").stat().st_ino
    assert src.is_dir()


def test_add_with_given_digest(store: LayerStore, tmp_path: Path) -> None:
    given = "sha256:" + "ab" * 32
    d = store.add_dir(make_tree(tmp_path / "src"), digest=given, source="oci")
    assert d == given
    assert store.has(given)
    assert store.info(given).size == 6 + 5004


def test_add_is_atomic(store: LayerStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_tree(tmp_path / "src")
    digest = tree_digest(src)[0]
    real_rename = os.rename

    def failing_publish(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> None:
        if Path(b) == store.layer_dir(digest):
            raise OSError(5, "simulated I/O error while publishing")
        real_rename(a, b)

    monkeypatch.setattr(layers_mod.os, "rename", failing_publish)
    with pytest.raises(OSError, match="simulated"):
        store.add_dir(src, mode="copy")
    monkeypatch.undo()
    # The layer never appeared half-written, and the staging area was cleaned up.
    assert not store.has(digest)
    assert not store.layer_dir(digest).exists()
    assert list(store.tmp.iterdir()) == []
    assert store.list() == []
    assert store.add_dir(src) == digest


def test_concurrent_adds_of_the_same_layer(store: LayerStore, tmp_path: Path) -> None:
    srcs = [make_tree(tmp_path / f"s{i}") for i in range(6)]
    results: list[str] = []
    errors: list[BaseException] = []

    def add(p: Path) -> None:
        try:
            results.append(store.add_dir(p))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=add, args=(p,)) for p in srcs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert len(store.list()) == 1
    assert list(store.tmp.iterdir()) == []


def test_move_across_filesystems_falls_back_to_copy(store: LayerStore) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(store.root.parent.parent).st_dev:
        pytest.skip("needs /dev/shm on another filesystem")
    src = make_tree(shm / f"aenv-test-layer-{os.getpid()}")
    try:
        d = store.add_dir(src)
        assert not src.exists()
        assert (store.path(d) / "etc/hostname").read_bytes() == b"hello\n"
    finally:
        shutil.rmtree(src, ignore_errors=True)


def test_move_across_filesystems_keeps_the_source_until_published(
    store: LayerStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seal onto another filesystem (a sandbox's disk) copies: if it is cut short before
    the layer is in the store, the source (the sandbox's upper) is whole."""
    src = make_tree(tmp_path / "src")
    digest = tree_digest(src)[0]
    real_rename = os.rename

    def across(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> None:
        if Path(a) == src:
            raise OSError(18, "Invalid cross-device link")  # EXDEV
        if Path(b) == store.layer_dir(digest):
            raise OSError(5, "simulated crash while publishing")
        real_rename(a, b)

    monkeypatch.setattr(layers_mod.os, "rename", across)
    with pytest.raises(OSError, match="simulated"):
        store.add_dir(src, mode="move")
    assert tree_digest(src)[0] == digest and not store.has(digest)
    monkeypatch.setattr(
        layers_mod.os, "rename", lambda a, b: across(a, b) if Path(a) == src else real_rename(a, b)
    )
    assert store.add_dir(src, mode="move") == digest
    assert not src.exists() and store.has(digest)


def test_remove(store: LayerStore, tmp_path: Path) -> None:
    d = store.add_dir(make_tree(tmp_path / "src"))
    (store.path(d) / "empty").chmod(0o500)
    assert store.remove(d) is True
    assert not store.has(d)
    assert not store.layer_dir(d).exists()
    assert store.remove(d) is False
    assert store.list() == []
    assert list(store.tmp.iterdir()) == []
    with pytest.raises(NotFound):
        store.info(d)


def test_touch_records_last_use(store: LayerStore, tmp_path: Path) -> None:
    d = store.add_dir(make_tree(tmp_path / "src"))
    assert store.info(d).last_used is None
    store.touch(d)
    assert store.info(d).last_used is not None


def test_staging_is_on_the_store_filesystem(store: LayerStore, tmp_path: Path) -> None:
    with store.staging() as stage:
        assert stage.parent == store.tmp
        make_tree(stage / "rootfs")
        d = store.add_dir(stage / "rootfs")
    assert store.has(d)
    assert list(store.tmp.iterdir()) == []


@pytest.mark.parametrize(
    "bad", ["sha256:../../etc", "sha256:XYZ", "md5:" + "a" * 32, "sha256-" + "a" * 64, ""]
)
def test_invalid_digests_are_rejected(store: LayerStore, bad: str) -> None:
    with pytest.raises(BadRequest):
        store.path(bad)
    with pytest.raises(BadRequest):
        store.has(bad)


def test_list_ignores_foreign_entries(store: LayerStore, tmp_path: Path) -> None:
    d = store.add_dir(make_tree(tmp_path / "src"))
    (store.root / "junk").mkdir()
    (store.root / ("sha256-" + "0" * 64)).mkdir()  # no meta.json: not a layer
    assert [i.digest for i in store.list()] == [d]
