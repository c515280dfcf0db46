"""Snapshot repository contract tests run on `LocalRepository` (the S3 backend runs the same
classes in tests/integration/test_repository_s3.py against a real S3 server), and the
local-only parts: atomic writes and staging, uncompressed stores, URL parsing and
configuration, the image cache, artifacts, a cancelled publish.

The contracts themselves are tests/contract/repository_contract.py and
tests/contract/store_contract.py.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.snapshots.artifacts import pack_dir, unpack_dir
from aenv.snapshots.cache import ImageCache
from aenv.snapshots.errors import (
    ArtifactCorrupt,
    ArtifactError,
    RepositoryConfigError,
    RepositoryError,
)
from aenv.snapshots.manifest import LayerRef, Manifest, Spec
from aenv.snapshots.repository import LocalRepository, Repository, S3Repository, open_repository
from aenv.snapshots.store import SnapshotStore
from tests.contract.repository_contract import RepositoryContract
from tests.contract.snapshot_trees import (
    assert_same_tree,
    empty,
    make_checkpoint,
    make_tree,
    sha256_file,
)
from tests.contract.store_contract import StoreContract


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
