"""The blob interface every snapshot repository backend implements identically: put, get,
list, delete, checksums, missing objects.

`RepositoryContract` is not collected by itself (no ``Test`` prefix): a backend's test module
(tests/unit/test_repository.py, tests/integration/test_repository_s3.py) subclasses it and
provides the ``repo`` fixture.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from aenv.snapshots.errors import ArtifactCorrupt, ObjectNotFound, RepositoryError
from aenv.snapshots.repository import ChecksumMismatch, Repository
from tests.contract.snapshot_trees import sha256_file


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
