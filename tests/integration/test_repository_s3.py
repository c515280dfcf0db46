"""The S3 backend against a real S3 server on loopback (moto's standalone server, started
here as a subprocess): the same repository and store contract tests as the local backend,
plus a 200 MB streaming round trip whose memory use must stay flat."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aenv.config import Settings
from aenv.snapshots.errors import RepositoryError
from aenv.snapshots.repository import Repository, S3Credentials, S3Repository, open_repository
from tests.contract.repository_contract import RepositoryContract
from tests.contract.store_contract import StoreContract

HOST = "127.0.0.1"
CREDS = S3Credentials("testing-key-id", "testing-secret")


@pytest.fixture
def bucket(s3_endpoint: str) -> str:
    """A fresh empty bucket per test."""
    name = f"aenv-{uuid.uuid4().hex[:12]}"
    r = httpx.put(f"{s3_endpoint}/{name}", timeout=10)
    assert r.status_code == 200, r.text
    return name


def _s3(endpoint: str, bucket: str, prefix: str = "repo/one") -> S3Repository:
    return S3Repository(bucket, prefix, endpoint=endpoint, region="us-east-1", credentials=CREDS)


class TestS3Repository(RepositoryContract):
    @pytest.fixture
    def repo(self, s3_endpoint: str, bucket: str) -> Repository:
        return _s3(s3_endpoint, bucket)

    async def test_prefixes_isolate_repositories(self, s3_endpoint: str, bucket: str) -> None:
        a, b = _s3(s3_endpoint, bucket, "a"), _s3(s3_endpoint, bucket, "a2")
        await a.put_bytes("manifests/x.json", b"a")
        assert await b.list() == []
        assert not await b.exists("manifests/x.json")
        root = _s3(s3_endpoint, bucket, "")
        assert [o.key for o in await root.list()] == ["a/manifests/x.json"]

    async def test_missing_bucket_is_a_clear_error(self, s3_endpoint: str) -> None:
        repo = _s3(s3_endpoint, "no-such-bucket-here")
        with pytest.raises(RepositoryError, match="no-such-bucket-here.*does not exist"):
            await repo.get_bytes("manifests/x.json")

    async def test_open_repository_from_environment(
        self, s3_endpoint: str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("AENV_SNAPSHOT_REPO", f"s3://{bucket}/from-env")
        monkeypatch.setenv("AENV_S3_ENDPOINT", s3_endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", CREDS.access_key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CREDS.secret_access_key)
        settings = Settings(home=tmp_path)
        repo = open_repository(settings.snapshots, settings.repo_dir)
        assert isinstance(repo, S3Repository)
        await repo.put_bytes("manifests/e.json", b"{}")
        assert [o.key for o in await _s3(s3_endpoint, bucket, "").list()] == [
            "from-env/manifests/e.json"
        ]

    async def test_200mb_round_trip_streams(
        self, s3_endpoint: str, bucket: str, tmp_path: Path
    ) -> None:
        size = 200 * 1024 * 1024
        src = tmp_path / "pages.img"
        want = _write_pages(src, 200)
        repo = _s3(s3_endpoint, bucket)
        with _peak_rss() as peak:
            t0 = time.monotonic()
            await repo.put_file("images/big/pages.img", src)
            t_put = time.monotonic() - t0
            t0 = time.monotonic()
            got = await repo.get_file(
                "images/big/pages.img", tmp_path / "back.img", sha256=want, size=size
            )
            t_get = time.monotonic() - t0
        assert got == want
        assert (tmp_path / "back.img").stat().st_size == size
        print(
            f"\n200 MiB over S3 (moto, loopback): put {200 / t_put:.0f} MB/s, "
            f"get {200 / t_get:.0f} MB/s, peak RSS growth {peak.growth / 2**20:.0f} MiB"
        )
        # Streaming: memory stays at parts × concurrency plus buffers, far below the size.
        assert peak.growth < 120 * 1024 * 1024, f"RSS grew by {peak.growth / 2**20:.0f} MiB"


class TestS3Store(StoreContract):
    @pytest.fixture
    def repo(self, s3_endpoint: str, bucket: str) -> Repository:
        return _s3(s3_endpoint, bucket)

    async def test_remote_images_are_compressed(self, repo: Repository, tmp_path: Path) -> None:
        node = self._store(repo, tmp_path / "n")
        assert node.image_compression == "zstd" and node.layer_compression == "zstd"


def _write_pages(path: Path, mib: int) -> str:
    """A pages.img-like file: alternating random and zero MiBs. Returns its sha256."""
    h = hashlib.sha256()
    block = os.urandom(1024 * 1024)
    with open(path, "wb") as f:
        for i in range(mib):
            chunk = block if i % 2 else bytes(len(block))
            f.write(chunk)
            h.update(chunk)
    return h.hexdigest()


class _Peak:
    def __init__(self) -> None:
        self.base = _rss()
        self.peak = self.base

    @property
    def growth(self) -> int:
        return self.peak - self.base


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def _peak_rss() -> Iterator[_Peak]:
    """Samples this process's resident memory every 20 ms while the block runs."""
    p = _Peak()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            p.peak = max(p.peak, _rss())
            stop.wait(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield p
    finally:
        stop.set()
        t.join()
        p.peak = max(p.peak, _rss())
