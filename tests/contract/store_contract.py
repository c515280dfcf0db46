"""SnapshotStore's behaviour over a repository backend: publish, fetch, verify, cache, delete.

`StoreContract` is not collected by itself (no ``Test`` prefix): a backend's test module
(tests/unit/test_repository.py, tests/integration/test_repository_s3.py) subclasses it and
provides the ``repo`` fixture.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from aenv.config import Settings, SnapshotSettings
from aenv.config.sections import Compression
from aenv.errors import AenvError, NotFound
from aenv.images.layers import LayerStore
from aenv.snapshots.errors import (
    ArtifactCorrupt,
    ArtifactError,
    ArtifactMissing,
    RepositoryError,
    SnapshotNotFound,
)
from aenv.snapshots.manifest import LayerRef, Manifest, Spec
from aenv.snapshots.repository import Repository
from aenv.snapshots.store import SnapshotStore
from tests.contract.snapshot_trees import assert_same_tree, empty, make_checkpoint, make_tree


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
