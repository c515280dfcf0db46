"""Snapshot repository contract tests (run here on `LocalRepository`; the S3 backend runs the
same classes in tests/integration/test_repository_s3.py against a real S3 server) and the
local-only parts: URL parsing, zero-copy paths, the image cache, artifacts.

`RepositoryContract` and `StoreContract` are not collected by themselves (no ``Test``
prefix): a backend's test module subclasses them and provides the ``repo`` fixture.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
import time
from pathlib import Path

import pytest

from aenv.config import Settings, SnapshotSettings
from aenv.config.sections import Compression
from aenv.errors import AenvError, NotFound
from aenv.images.layers import LayerStore, tree_digest
from aenv.snapshots.artifacts import pack_dir, unpack_dir
from aenv.snapshots.cache import ImageCache
from aenv.snapshots.errors import (
    ArtifactCorrupt,
    ArtifactError,
    ArtifactMissing,
    ObjectNotFound,
    RepositoryConfigError,
    RepositoryError,
    SnapshotNotFound,
)
from aenv.snapshots.manifest import LayerRef, Manifest, Spec
from aenv.snapshots.repository import (
    ChecksumMismatch,
    LocalRepository,
    Repository,
    S3Repository,
    open_repository,
)
from aenv.snapshots.store import SnapshotStore

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


# --------------------------------------------------------------------------- contracts
class RepositoryContract:
    """The blob interface every backend implements identically."""

    @pytest.fixture
    def repo(self) -> Repository:  # pragma: no cover - overridden
        raise NotImplementedError

    async def test_bytes_round_trip_and_overwrite(self, repo: Repository) -> None:
        await repo.put_bytes("manifests/a.json", b'{"a": 1}')
        assert await repo.get_bytes("manifests/a.json") == b'{"a": 1}'
        await repo.put_bytes("manifests/a.json", b"second")
        assert await repo.get_bytes("manifests/a.json") == b"second"
        info = await repo.stat("manifests/a.json")
        assert info is not None and info.size == 6 and info.key == "manifests/a.json"
        assert abs(info.last_modified - time.time()) < 120

    async def test_file_round_trip_streams_and_hashes(
        self, repo: Repository, tmp_path: Path
    ) -> None:
        src = tmp_path / "src.bin"
        src.write_bytes(os.urandom(9 * 1024 * 1024 + 17))  # more than one part / chunk
        await repo.put_file("images/x/pages.img", src)
        assert src.exists()
        dest = tmp_path / "out" / "pages.img"
        digest = await repo.get_file("images/x/pages.img", dest)
        assert digest == sha256_file(src)
        assert dest.read_bytes() == src.read_bytes()
        assert [p.name for p in dest.parent.iterdir()] == ["pages.img"]  # no temp left

    async def test_put_file_move_gives_the_file_up(self, repo: Repository, tmp_path: Path) -> None:
        src = tmp_path / "moved"
        src.write_bytes(b"payload")
        await repo.put_file("layers/sha256-00/obj", src, move=True)
        assert not src.exists()
        assert await repo.get_bytes("layers/sha256-00/obj") == b"payload"

    async def test_missing_objects(self, repo: Repository, tmp_path: Path) -> None:
        with pytest.raises(ObjectNotFound, match="nope"):
            await repo.get_bytes("manifests/nope.json")
        with pytest.raises(ObjectNotFound):
            await repo.get_file("images/nope/pages.img", tmp_path / "x")
        assert not (tmp_path / "x").exists()
        assert await repo.stat("manifests/nope.json") is None
        assert not await repo.exists("manifests/nope.json")
        await repo.delete("manifests/nope.json")  # no error

    async def test_get_file_checksum_mismatch_leaves_dest_alone(
        self, repo: Repository, tmp_path: Path
    ) -> None:
        await repo.put_bytes("images/c/file", b"actual content")
        (tmp_path / "d").mkdir()
        dest = tmp_path / "d" / "dest"
        dest.write_bytes(b"previous")
        with pytest.raises(ChecksumMismatch) as ei:
            await repo.get_file("images/c/file", dest, sha256="0" * 64)
        assert isinstance(ei.value, ArtifactCorrupt)
        with pytest.raises(ChecksumMismatch, match="bytes"):
            await repo.get_file("images/c/file", dest, size=3)
        assert dest.read_bytes() == b"previous"
        assert os.listdir(tmp_path / "d") == ["dest"]
        good = hashlib.sha256(b"actual content").hexdigest()
        assert await repo.get_file("images/c/file", dest, sha256=good, size=14) == good

    async def test_list_is_directory_like_and_sorted(self, repo: Repository) -> None:
        for key in ["a/b/c", "a/b/d/e", "a/bc", "ab", "z"]:
            await repo.put_bytes(key, key.encode())
        assert [o.key for o in await repo.list("a/b")] == ["a/b/c", "a/b/d/e"]
        assert [o.key for o in await repo.list("a/b/")] == ["a/b/c", "a/b/d/e"]
        assert [o.key for o in await repo.list("a")] == ["a/b/c", "a/b/d/e", "a/bc"]
        assert [o.key for o in await repo.list()] == ["a/b/c", "a/b/d/e", "a/bc", "ab", "z"]
        assert await repo.list("nothing/here") == []
        sizes = {o.key: o.size for o in await repo.list()}
        assert sizes["a/b/d/e"] == len(b"a/b/d/e")

    async def test_delete_and_delete_prefix(self, repo: Repository) -> None:
        for key in ["images/s1/x/pages.img", "images/s1/y/checkpoint.img", "images/s10/z", "m"]:
            await repo.put_bytes(key, b"1")
        await repo.delete("m")
        assert not await repo.exists("m")
        assert await repo.delete_prefix("images/s1") == 2
        assert [o.key for o in await repo.list()] == ["images/s10/z"]
        assert await repo.delete_prefix("images/none") == 0

    @pytest.mark.parametrize(
        "key", ["", "/abs", "a//b", "../up", "a/../b", "a/./b", ".tmp/x", "a/.hidden", "a\\b"]
    )
    async def test_invalid_keys_are_rejected(self, repo: Repository, key: str) -> None:
        with pytest.raises(RepositoryError, match="invalid repository key"):
            await repo.put_bytes(key, b"x")
        with pytest.raises(RepositoryError):
            await repo.get_bytes(key)


class StoreContract:
    """SnapshotStore behaviour over a backend: publish, fetch, verify, cache, delete."""

    compression: Compression = "auto"

    @pytest.fixture
    def repo(self) -> Repository:  # pragma: no cover - overridden
        raise NotImplementedError

    @pytest.fixture
    def node(self, repo: Repository, tmp_path: Path) -> SnapshotStore:
        return self._store(repo, tmp_path / "node1")

    @pytest.fixture
    def other_node(self, repo: Repository, tmp_path: Path) -> SnapshotStore:
        """A second node sharing the repository, with its own (empty) layer store/cache."""
        return self._store(repo, tmp_path / "node2")

    def _store(
        self,
        repo: Repository,
        home: Path,
        *,
        cache_size: int | None = None,
        compression: Compression | None = None,
    ) -> SnapshotStore:
        settings = Settings(home=home)
        snap = SnapshotSettings(
            snapshot_compression=compression or self.compression, snapshot_gc_grace_seconds=3600
        )
        return SnapshotStore(
            snap, repo, LayerStore(settings), cache_dir=settings.cache_dir, cache_size=cache_size
        )

    def _layer(self, store: SnapshotStore, tmp_path: Path, tag: str) -> str:
        src = make_tree(tmp_path / f"tree-{tag}-{os.urandom(4).hex()}", tag)
        return store.layers.add_dir(src, mode="copy")

    def _manifest(self, sid: str, digests: list[str], **kw: object) -> Manifest:
        return Manifest(
            id=sid,
            layers=[LayerRef(digest=d) for d in digests],
            spec=Spec(cpu_count=2, memory_mb=512, env={"A": "1"}, workdir="/root"),
            envd={"version": "0.1"},
            **kw,  # type: ignore[arg-type]
        )

    async def test_round_trip_to_another_node(
        self, node: SnapshotStore, other_node: SnapshotStore, tmp_path: Path
    ) -> None:
        base = self._layer(node, tmp_path, "base")
        top = self._layer(node, tmp_path, "top")
        ckpt = make_checkpoint(tmp_path / "ckpt", "one")
        published = await node.publish(
            self._manifest("snap-1", [top, base], parent="tmpl-0", names=["n"]),
            checkpoint_dir=ckpt,
        )
        assert published.is_complete()
        assert published.layer_digests == [top, base]
        assert published.checkpoint is not None
        assert {f.name for f in published.checkpoint.files} == {
            "checkpoint.img",
            "pages.img",
            "pages_meta.img",
        }
        assert all(ckpt.joinpath(n).exists() for n in ("checkpoint.img", "pages.img"))

        m, image = await other_node.fetch("snap-1")
        assert m == published
        assert m.parent == "tmpl-0" and m.spec.env == {"A": "1"} and m.names == ["n"]
        for d in (top, base):
            assert other_node.layers.has(d)
            assert_same_tree(node.layers.path(d), other_node.layers.path(d))
        assert image is not None
        for name in ("checkpoint.img", "pages.img", "pages_meta.img"):
            assert (image / name).read_bytes() == (ckpt / name).read_bytes()
        assert sorted(p.name for p in image.iterdir()) == [
            "checkpoint.img",
            "pages.img",
            "pages_meta.img",
        ]
        # Idempotent, and served from the cache the second time.
        m2, image2 = await other_node.fetch("snap-1")
        assert image2 == image and m2 == m
        # Nothing left in staging areas.
        assert empty(other_node.work)
        assert empty(other_node.layers.tmp)

    async def test_filesystem_only_snapshot(
        self, node: SnapshotStore, other_node: SnapshotStore, tmp_path: Path
    ) -> None:
        d = self._layer(node, tmp_path, "fs")
        await node.publish(self._manifest("fs-only", [d], kind="template"))
        m, image = await other_node.fetch("fs-only")
        assert image is None and m.kind == "template" and other_node.layers.has(d)

    async def test_incremental_publish_uploads_shared_layer_once(
        self,
        node: SnapshotStore,
        repo: Repository,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        shared = self._layer(node, tmp_path, "shared")
        a = self._layer(node, tmp_path, "a")
        b = self._layer(node, tmp_path, "b")
        uploads: list[str] = []
        real_put = repo.put_file

        async def spy(key: str, path: Path, *, move: bool = False) -> None:
            uploads.append(key)
            await real_put(key, path, move=move)

        monkeypatch.setattr(repo, "put_file", spy)
        m1 = await node.publish(self._manifest("s1", [a, shared]))
        m2 = await node.publish(self._manifest("s2", [b, shared]))
        layer_uploads = [k for k in uploads if k.startswith("layers/")]
        assert len(layer_uploads) == 3  # a, shared, b — shared only once
        assert m1.layers[1].object is not None and m2.layers[1].object is not None
        assert m1.layers[1].object.key == m2.layers[1].object.key
        shared_dir = m1.layers[1].object.key.rsplit("/", 1)[0]
        assert len(await repo.list(shared_dir)) == 1
        # Publishing from a node that no longer has the layer locally works too: the
        # repository has it.
        node.layers.remove(shared)
        await node.publish(self._manifest("s3", [shared]))
        assert len([k for k in uploads if k.startswith("layers/")]) == 3

    async def test_publish_without_the_layer_anywhere_is_a_clear_error(
        self, node: SnapshotStore
    ) -> None:
        ghost = "sha256:" + "ab" * 32
        with pytest.raises(ArtifactError, match="neither in the repository nor on this node"):
            await node.publish(self._manifest("ghost", [ghost]))
        assert not await node.exists("ghost")

    async def test_manifest_is_written_last(
        self,
        node: SnapshotStore,
        repo: Repository,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        d = self._layer(node, tmp_path, "x")
        real_put = repo.put_file

        async def failing(key: str, path: Path, *, move: bool = False) -> None:
            if key.startswith("images/"):
                raise RepositoryError("simulated crash while uploading the memory image")
            await real_put(key, path, move=move)

        monkeypatch.setattr(repo, "put_file", failing)
        with pytest.raises(RepositoryError, match="simulated"):
            await node.publish(
                self._manifest("half", [d]), checkpoint_dir=make_checkpoint(tmp_path / "c", "h")
            )
        assert not await node.exists("half")
        with pytest.raises(SnapshotNotFound):
            await node.fetch("half")
        # The orphaned layer object is swept by gc once older than the grace period.
        assert await repo.list("layers")
        assert await node.gc(grace=3600) == []
        swept = await node.gc(grace=0)
        assert swept and all(k.startswith("layers/") for k in swept)
        assert await repo.list("layers") == []

    async def test_corrupt_layer_is_a_clear_error_and_restores_nothing(
        self,
        node: SnapshotStore,
        other_node: SnapshotStore,
        repo: Repository,
        tmp_path: Path,
    ) -> None:
        d = self._layer(node, tmp_path, "c")
        m = await node.publish(self._manifest("corrupt-l", [d]))
        ref = m.layers[0].object
        assert ref is not None
        good = await repo.get_bytes(ref.key)
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0xFF  # same size, one flipped byte
        await repo.put_bytes(ref.key, bytes(bad))
        with pytest.raises(ArtifactCorrupt) as ei:
            await other_node.fetch("corrupt-l")
        msg = ei.value.message
        assert "corrupt-l" in msg and d in msg and ref.key in msg
        assert ei.value.snapshot_id == "corrupt-l" and ei.value.status == 500
        assert not other_node.layers.has(d)
        assert not other_node.layers.layer_dir(d).exists()
        assert empty(other_node.layers.tmp)
        assert empty(other_node.work)
        # Truncated: the size differs.
        await repo.put_bytes(ref.key, good[:100])
        with pytest.raises(ArtifactCorrupt):
            await other_node.fetch("corrupt-l")
        # Repaired: works again.
        await repo.put_bytes(ref.key, good)
        await other_node.fetch("corrupt-l")
        assert other_node.layers.has(d)

    async def test_corrupt_memory_image_is_a_clear_error(
        self,
        node: SnapshotStore,
        other_node: SnapshotStore,
        repo: Repository,
        tmp_path: Path,
    ) -> None:
        d = self._layer(node, tmp_path, "m")
        m = await node.publish(
            self._manifest("corrupt-i", [d]), checkpoint_dir=make_checkpoint(tmp_path / "c", "i")
        )
        assert m.checkpoint is not None
        pages = next(f for f in m.checkpoint.files if f.name == "pages.img")
        data = bytearray(await repo.get_bytes(pages.object.key))
        data[-1] ^= 0x01
        await repo.put_bytes(pages.object.key, bytes(data))
        with pytest.raises(ArtifactCorrupt, match="pages.img") as ei:
            await other_node.fetch("corrupt-i")
        assert ei.value.snapshot_id == "corrupt-i"
        assert other_node.cache.entries() == []
        assert empty(other_node.work)

    async def test_missing_objects_are_clear_errors(
        self,
        node: SnapshotStore,
        other_node: SnapshotStore,
        repo: Repository,
        tmp_path: Path,
    ) -> None:
        d = self._layer(node, tmp_path, "gone")
        m = await node.publish(
            self._manifest("missing", [d]), checkpoint_dir=make_checkpoint(tmp_path / "c", "g")
        )
        assert m.checkpoint is not None and m.layers[0].object is not None
        ck = m.checkpoint.files[0]
        await repo.delete(ck.object.key)
        with pytest.raises(ArtifactMissing, match=ck.name) as ei:
            await other_node.fetch("missing")
        assert ck.object.key in ei.value.message and "missing" in ei.value.message
        assert other_node.cache.entries() == []
        await repo.delete(m.layers[0].object.key)
        other_node.layers.remove(d)
        with pytest.raises(ArtifactMissing, match=d):
            await other_node.fetch("missing")
        assert not other_node.layers.has(d)

    async def test_unknown_snapshot_is_404(self, node: SnapshotStore) -> None:
        with pytest.raises(SnapshotNotFound) as ei:
            await node.fetch("never-published")
        assert isinstance(ei.value, NotFound) and ei.value.status == 404
        with pytest.raises(SnapshotNotFound):
            await node.delete("never-published")
        with pytest.raises(AenvError):
            await node.get("../escape")

    async def test_delete_sweeps_unreferenced_objects_only(
        self, node: SnapshotStore, repo: Repository, tmp_path: Path
    ) -> None:
        shared = self._layer(node, tmp_path, "shared")
        only1 = self._layer(node, tmp_path, "only1")
        only2 = self._layer(node, tmp_path, "only2")
        m1 = await node.publish(
            self._manifest("d1", [only1, shared]),
            checkpoint_dir=make_checkpoint(tmp_path / "c1", "1"),
        )
        m2 = await node.publish(
            self._manifest("d2", [only2, shared]),
            checkpoint_dir=make_checkpoint(tmp_path / "c2", "2"),
        )
        # An orphan of some other node's crashed publish, recent: must survive the sweep.
        orphan = f"layers/sha256-{'cd' * 32}/{'ef' * 32}.tar.zst"
        await repo.put_bytes(orphan, b"in flight elsewhere")

        await node.delete("d1")
        assert not await node.exists("d1")
        keys = {o.key for o in await repo.list()}
        for o in m2.objects():
            assert o.key in keys, f"{o.key} of d2 was swept"
        assert m1.layers[0].object is not None
        assert m1.layers[0].object.key not in keys
        assert not [k for k in keys if k.startswith("images/d1/")]
        assert orphan in keys
        assert [m.id for m in await node.list()] == ["d2"]

        await node.delete("d2")
        keys = {o.key for o in await repo.list()}
        assert keys == {orphan}
        assert await node.gc(grace=0) == [orphan]

    async def test_republish_replaces_and_sweeps_old_image(
        self,
        node: SnapshotStore,
        other_node: SnapshotStore,
        repo: Repository,
        tmp_path: Path,
    ) -> None:
        d = self._layer(node, tmp_path, "h")
        await node.publish(
            self._manifest("sbx-1", [d], kind="hibernation"),
            checkpoint_dir=make_checkpoint(tmp_path / "c1", "first"),
        )
        _, img1 = await other_node.fetch("sbx-1")
        assert img1 is not None
        assert (img1 / "checkpoint.img").read_bytes().startswith(b"first")
        await node.publish(
            self._manifest("sbx-1", [d], kind="hibernation"),
            checkpoint_dir=make_checkpoint(tmp_path / "c2", "second"),
        )
        _, img2 = await other_node.fetch("sbx-1")
        assert img2 is not None and img2 != img1
        assert (img2 / "checkpoint.img").read_bytes().startswith(b"second")
        assert not img1.exists()  # the stale image left the cache
        images = [o.key for o in await repo.list("images/sbx-1")]
        assert len(images) == 3  # only the current image's three files

    async def test_concurrent_fetches_of_one_snapshot(
        self, node: SnapshotStore, other_node: SnapshotStore, tmp_path: Path
    ) -> None:
        d = self._layer(node, tmp_path, "cc")
        await node.publish(
            self._manifest("cc", [d]), checkpoint_dir=make_checkpoint(tmp_path / "c", "cc")
        )
        results = await asyncio.gather(*(other_node.fetch("cc") for _ in range(4)))
        assert len({r[1] for r in results}) == 1
        assert len(other_node.cache.entries()) == 1

    async def test_cache_is_bounded_and_respects_pins(
        self, repo: Repository, tmp_path: Path
    ) -> None:
        # Compressed images: the cache owns the bytes it fetches (nothing hard-linked).
        pub = self._store(repo, tmp_path / "pub", compression="zstd")
        for i in range(3):
            d = self._layer(pub, tmp_path, f"e{i}")
            await pub.publish(
                self._manifest(f"e{i}", [d]),
                checkpoint_dir=make_checkpoint(tmp_path / f"c{i}", f"e{i}", size=400_000),
            )
        # Room for about two images (each ~420 kB once fetched).
        node = self._store(repo, tmp_path / "n", cache_size=1_000_000)
        with node.pin("e0"):
            _, p0 = await node.fetch("e0")
            assert p0 is not None
            os.utime(p0, (1, 1))  # least recently used, but pinned
            _, p1 = await node.fetch("e1")
            assert p1 is not None
            os.utime(p1, (2, 2))
            _, p2 = await node.fetch("e2")
            assert p2 is not None
            assert p0.exists(), "a pinned image was evicted"
            assert p2.exists(), "the image just fetched was evicted"
            assert not p1.exists(), "the least recently used unpinned image should be gone"
            assert 0 < node.cache.usage() <= 1_000_000
        # Unpinned now: the next eviction may take e0.
        node.cache.capacity = 0
        node.cache.evict()
        assert node.cache.entries() == []


# --------------------------------------------------------------------------- local backend
class TestLocalRepository(RepositoryContract):
    @pytest.fixture
    def repo(self, tmp_path: Path) -> Repository:
        return LocalRepository(tmp_path / "repo")

    async def test_writes_are_atomic_and_objects_read_only(self, tmp_path: Path) -> None:
        repo = LocalRepository(tmp_path / "repo")
        src = tmp_path / "f"
        src.write_bytes(b"x" * 1000)
        await repo.put_file("layers/sha256-aa/o.tar", src)
        p = repo.local_path("layers/sha256-aa/o.tar")
        assert p is not None and stat.S_IMODE(p.stat().st_mode) == 0o444
        assert empty(repo.tmp)
        assert repo.local_path("layers/sha256-aa/missing") is None
        # Deleting prunes empty directories.
        await repo.delete("layers/sha256-aa/o.tar")
        assert not (tmp_path / "repo/layers").exists()

    async def test_clean_staging_removes_old_temp_files(self, tmp_path: Path) -> None:
        repo = LocalRepository(tmp_path / "repo")
        repo.tmp.mkdir(parents=True)
        old = repo.tmp / "crashed.part"
        old.write_bytes(b"x")
        os.utime(old, (1, 1))
        (repo.tmp / "fresh.part").write_bytes(b"y")
        assert repo.clean_staging(older_than=3600) == 1
        assert [p.name for p in repo.tmp.iterdir()] == ["fresh.part"]
        assert await repo.list() == []

    def test_relative_root_is_rejected(self) -> None:
        with pytest.raises(RepositoryError, match="absolute"):
            LocalRepository(Path("relative/repo"))


class TestLocalStore(StoreContract):
    @pytest.fixture
    def repo(self, tmp_path: Path) -> Repository:
        return LocalRepository(tmp_path / "repo")

    async def test_local_fetch_shares_instead_of_copying(
        self, node: SnapshotStore, other_node: SnapshotStore, repo: Repository, tmp_path: Path
    ) -> None:
        assert node.image_compression == "none"
        d = self._layer(node, tmp_path, "z")
        m = await node.publish(
            self._manifest("zc", [d]), checkpoint_dir=make_checkpoint(tmp_path / "c", "z")
        )
        assert m.checkpoint is not None
        _, image = await other_node.fetch("zc")
        assert image is not None
        for f in m.checkpoint.files:
            obj = repo.local_path(f.object.key)
            assert obj is not None
            assert (image / f.name).stat().st_ino == obj.stat().st_ino  # hard link / reflink
        assert other_node.cache.usage() == 0  # shared bytes are not the cache's

    async def test_publish_move_checkpoint_renames_and_seeds_cache(
        self, node: SnapshotStore, repo: Repository, tmp_path: Path
    ) -> None:
        d = self._layer(node, tmp_path, "mv")
        ckpt = make_checkpoint(tmp_path / "c", "mv")
        inode = (ckpt / "pages.img").stat().st_ino
        m = await node.publish(self._manifest("mv", [d]), checkpoint_dir=ckpt, move_checkpoint=True)
        assert m.checkpoint is not None
        pages = next(f for f in m.checkpoint.files if f.name == "pages.img")
        obj = repo.local_path(pages.object.key)
        assert obj is not None and obj.stat().st_ino == inode  # renamed, not copied
        assert not (ckpt / "pages.img").exists()
        # The publishing node has the image cached already: no fetch needed.
        cached = node.cache.lookup("mv", m.checkpoint.fingerprint())
        assert cached is not None and (cached / "pages.img").stat().st_ino == inode
        _, image = await node.fetch("mv")
        assert image == cached

    async def test_checkpoint_dir_must_hold_regular_files(
        self, node: SnapshotStore, tmp_path: Path
    ) -> None:
        d = self._layer(node, tmp_path, "bad")
        ckpt = make_checkpoint(tmp_path / "c", "bad")
        (ckpt / "sub").mkdir()
        with pytest.raises(ArtifactError, match="only regular files"):
            await node.publish(self._manifest("bad", [d]), checkpoint_dir=ckpt)
        assert not await node.exists("bad")

    async def test_unreadable_manifest_blocks_sweeping(
        self, node: SnapshotStore, repo: Repository, tmp_path: Path
    ) -> None:
        d = self._layer(node, tmp_path, "u")
        await node.publish(self._manifest("keep", [d]))
        await node.publish(self._manifest("drop", [d]))
        await repo.put_bytes("manifests/broken.json", b"{not json")
        assert {m.id for m in await node.list()} == {"keep", "drop"}
        with pytest.raises(ArtifactError, match="broken"):
            await node.get("broken")
        orphan = "layers/sha256-" + "11" * 32 + "/" + "22" * 32 + ".tar"
        await repo.put_bytes(orphan, b"o")
        assert await node.gc(grace=0) == []  # refuses to sweep blind
        assert await repo.exists(orphan)


class TestLocalStoreUncompressed(StoreContract):
    """The same behaviour with compression off everywhere."""

    compression = "none"

    @pytest.fixture
    def repo(self, tmp_path: Path) -> Repository:
        return LocalRepository(tmp_path / "repo")


# --------------------------------------------------------------------------- configuration
def _open(home: Path) -> Repository:
    """The repository a node with this home opens, configured from the environment."""
    settings = Settings(home=home)
    return open_repository(settings.snapshots, settings.repo_dir)


class TestOpenRepository:
    @pytest.fixture(autouse=True)
    def _clean_env(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        monkeypatch.setenv("AENV_CONFIG_FILE", str(tmp_path / "absent.toml"))
        for var in (
            "AENV_SNAPSHOT_REPO",
            "AENV_S3_ENDPOINT",
            "AENV_S3_REGION",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
        ):
            monkeypatch.delenv(var, raising=False)

    def test_default_is_a_local_repo_under_home(self, tmp_path: Path) -> None:
        repo = _open(tmp_path)
        assert isinstance(repo, LocalRepository) and repo.root == tmp_path / "repo"

    @pytest.mark.parametrize("url", ["file:///srv/aenv%20repo", "file://localhost/srv/aenv repo"])
    def test_file_urls(self, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("AENV_SNAPSHOT_REPO", url)
        repo = _open(tmp_path)
        assert isinstance(repo, LocalRepository) and repo.root == Path("/srv/aenv repo")

    def test_s3_url_with_endpoint_and_credentials(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("AENV_SNAPSHOT_REPO", "s3://my-bucket/some/prefix/")
        monkeypatch.setenv("AENV_S3_ENDPOINT", "http://127.0.0.1:9000")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
        repo = _open(tmp_path)
        assert isinstance(repo, S3Repository)
        assert repo.bucket == "my-bucket" and repo.prefix == "some/prefix"
        assert "s3cr3t" not in repr(repo) and "s3cr3t" not in repo.url

    @pytest.mark.parametrize(
        ("url", "why"),
        [
            ("relative/path", "unsupported"),
            ("ftp://host/x", "unsupported"),
            ("file://host/x", "no host"),
            ("file://", "absolute"),
            ("s3://", "not a valid bucket"),
            ("s3://Bad_Bucket/x", "not a valid bucket"),
            ("s3://key:secret@bucket/x", "no credentials"),
            ("s3://bucket/a/../b", "invalid prefix"),
            ("s3://bucket/x?versionId=1", "s3://bucket/prefix"),
        ],
    )
    def test_malformed_urls_are_clear_errors(
        self, url: str, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("AENV_SNAPSHOT_REPO", url)
        with pytest.raises(RepositoryConfigError, match=why) as ei:
            _open(tmp_path)
        assert url in ei.value.message or why in ei.value.message

    def test_bad_endpoint_and_half_credentials(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("AENV_SNAPSHOT_REPO", "s3://bucket/p")
        monkeypatch.setenv("AENV_S3_ENDPOINT", "127.0.0.1:9000")
        with pytest.raises(RepositoryConfigError, match="AENV_S3_ENDPOINT"):
            _open(tmp_path)
        monkeypatch.setenv("AENV_S3_ENDPOINT", "http://127.0.0.1:9000")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "only-the-id")
        with pytest.raises(RepositoryConfigError, match="AWS_SECRET_ACCESS_KEY"):
            _open(tmp_path)


# --------------------------------------------------------------------------- pieces
class TestImageCache:
    def _entry(self, cache: ImageCache, sid: str, size: int) -> Path:
        with cache.staging() as st:
            (st / "pages.img").write_bytes(os.urandom(size))
            return cache.install(sid, "f" * 16, st)

    def test_lru_eviction_skips_pinned_and_kept(self, tmp_path: Path) -> None:
        cache = ImageCache(tmp_path / "images", capacity=10 * 4096)
        a = self._entry(cache, "a", 4 * 4096)
        b = self._entry(cache, "b", 4 * 4096)
        os.utime(a, (100, 100))
        os.utime(b, (200, 200))
        with cache.pin("a"):
            c = self._entry(cache, "c", 4 * 4096)
            removed = cache.evict(keep=frozenset({"c"}))
            assert [e.snapshot_id for e in removed] == ["b"]
            assert a.exists() and c.exists() and not b.exists()
            assert not cache.remove("a")  # pinned
        assert cache.lookup("a", "f" * 16) == a  # marks it used: now newest
        os.utime(c, (50, 50))
        cache.capacity = 5 * 4096
        assert [e.snapshot_id for e in cache.evict()] == ["c"]
        assert cache.remove("a") and cache.entries() == []
        assert not (tmp_path / "images/a").exists()

    def test_nested_pins_count(self, tmp_path: Path) -> None:
        cache = ImageCache(tmp_path / "images", capacity=0)
        self._entry(cache, "x", 4096)
        with cache.pin("x"):
            with cache.pin("x"):
                pass
            assert cache.is_pinned("x")
            assert cache.evict() == []
        assert not cache.is_pinned("x")
        assert len(cache.evict()) == 1


class TestArtifacts:
    @pytest.mark.parametrize("compression", ["none", "zstd"])
    def test_dir_round_trip(self, tmp_path: Path, compression: str) -> None:
        src = make_tree(tmp_path / "src", "rt")
        packed = pack_dir(src, tmp_path / "obj", compression=compression)  # type: ignore[arg-type]
        assert packed.sha256 == sha256_file(tmp_path / "obj")
        assert packed.size == (tmp_path / "obj").stat().st_size
        unpack_dir(tmp_path / "obj", tmp_path / "out", compression=compression)  # type: ignore[arg-type]
        assert_same_tree(src, tmp_path / "out")

    @pytest.mark.parametrize("compression", ["none", "zstd"])
    def test_garbage_does_not_leave_a_partial_dir(self, tmp_path: Path, compression: str) -> None:
        src = make_tree(tmp_path / "src", "g")
        pack_dir(src, tmp_path / "obj", compression=compression)  # type: ignore[arg-type]
        data = (tmp_path / "obj").read_bytes()
        (tmp_path / "obj").write_bytes(data[: len(data) // 2])
        with pytest.raises(ArtifactCorrupt):
            unpack_dir(tmp_path / "obj", tmp_path / "out", compression=compression)  # type: ignore[arg-type]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["obj", "src"]

    def test_manifest_json_round_trip(self) -> None:
        m = Manifest(
            id="t-1",
            kind="template",
            layers=[LayerRef(digest="sha256:" + "a" * 64, size=3)],
            spec=Spec(cpu_count=1, start_cmd="sleep infinity", custom="kept"),  # type: ignore[call-arg]
            envd={"processes": []},
            names=["base"],
        )
        back = Manifest.from_json(m.to_json())
        assert back == m and back.spec.model_extra == {"custom": "kept"}
        with pytest.raises(ArtifactError, match="manifest"):
            Manifest.from_json(b'{"id": "x", "layers": [{"digest": "md5:1"}]}')


async def test_cancelled_publish_stops_packing_in_its_thread(tmp_path: Path) -> None:
    from aenv.snapshots.artifacts import PackCancelled, cancellable, pack_dir, pack_file

    src = tmp_path / "tree"
    src.mkdir()
    (src / "big").write_bytes(os.urandom(9 << 20))  # a few chunks
    with cancellable() as stop:
        stop.set()
        # asyncio.to_thread runs in a copy of this context: the worker sees the event.
        with pytest.raises(PackCancelled):
            await asyncio.to_thread(pack_dir, src, tmp_path / "t.tar.zst", compression="zstd")
        with pytest.raises(PackCancelled):
            await asyncio.to_thread(pack_file, src / "big", tmp_path / "f.zst", compression="zstd")
    assert not (tmp_path / "t.tar.zst").exists() and not (tmp_path / "f.zst").exists()
    # Outside the scope nothing is cancelled.
    packed = await asyncio.to_thread(pack_file, src / "big", tmp_path / "g", compression="none")
    assert packed.size == 9 << 20
