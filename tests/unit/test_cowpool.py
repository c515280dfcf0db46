"""The btrfs pool on a real loop-mounted filesystem (root only): a sandbox's size holds, a
snapshot's copy of its upper takes no space (reflinks), files survive a remount, and a home
made before keeps its layout."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.images.layers import LayerStore
from aenv.orchestrator.storage import SandboxStorage
from aenv.runtime.rootfs import is_mount_point
from aenv.runtime.storage import cowpool
from aenv.runtime.storage.cowpool import CowPool, open_pool
from tests.helpers import wait_until
from tests.unit.test_disks import fill

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mkfs.btrfs") is None,
    reason="a btrfs pool needs root and btrfs-progs",
)

MIB = 2**20


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home", storage="btrfs", default_disk_mb=32)


@pytest.fixture
def pool(settings: Settings) -> Iterator[CowPool]:
    p = open_pool(settings)
    assert p is not None
    try:
        yield p
    finally:
        p.unmount()


def pool_used(pool: CowPool) -> int:
    subprocess.run(["btrfs", "filesystem", "sync", str(pool.rw_dir)], check=True)
    sv = os.statvfs(pool.rw_dir)
    return (sv.f_blocks - sv.f_bfree) * sv.f_frsize


def test_the_pool_holds_layers_and_uppers(settings: Settings, pool: CowPool) -> None:
    assert pool.image.exists()
    assert is_mount_point(settings.layers_dir) and is_mount_point(settings.rw_dir)
    # Sparse: the file takes what the filesystem wrote, not its size.
    assert pool.image.stat().st_blocks * 512 < 64 * MIB < pool.image.stat().st_size


def test_a_sandbox_stops_at_its_size_and_leaves_the_others_alone(pool: CowPool) -> None:
    a = pool.attach("sbx1", 16)
    assert fill(a / "big", 64) == errno.EDQUOT
    b = pool.attach("sbx2", 16)
    assert fill(b / "small", 4) == 0
    assert pool.attach("sbx2", 16) == b and (b / "small").exists()  # idempotent
    assert pool.owners() == {"sbx1", "sbx2"}
    subprocess.run(["btrfs", "filesystem", "sync", str(pool.rw_dir)], check=True)
    used, total = pool.usage("sbx2", 16)
    assert 4 * MIB <= used < 8 * MIB and total == 16 * MIB
    pool.detach("sbx1")
    assert not a.exists() and pool.owners() == {"sbx2"}


def test_a_snapshot_copies_an_upper_without_its_data(settings: Settings, pool: CowPool) -> None:
    storage = SandboxStorage(settings, LayerStore(settings), pool)
    upper = storage.first_upper("sbx")
    storage.ensure_upper("sbx", upper, 512)
    (upper / "big").write_bytes(os.urandom(64 * MIB))
    before = pool_used(pool)
    digest = storage.copy_upper(upper, "sbx")
    assert digest is not None
    assert pool_used(pool) - before < 8 * MIB  # shared extents, not a second 64 MiB
    assert (storage.layers.path(digest) / "big").stat().st_size == 64 * MIB

    # The next snapshot copies what changed, by reflink too.
    with open(upper / "big", "r+b") as f:
        f.write(b"changed")
    (upper / "new").write_bytes(os.urandom(32 * MIB))
    before = pool_used(pool)
    top = storage.copy_upper_since(upper, "sbx", [digest])
    assert top is not None
    assert pool_used(pool) - before < 8 * MIB
    assert (storage.layers.path(top) / "big").read_bytes()[:7] == b"changed"
    assert (storage.layers.path(top) / "new").stat().st_size == 32 * MIB

    # The sandbox's own files are its own: the copies stay when it goes.
    storage.remove_sandbox("sbx")
    assert not (settings.rw_dir / "sbx").exists()
    assert (storage.layers.path(top) / "new").stat().st_size == 32 * MIB


def test_files_survive_a_remount(settings: Settings, pool: CowPool) -> None:
    (pool.attach("sbx", 16) / "kept").write_text("hello")
    (settings.layers_dir / "a-layer").mkdir()
    pool.unmount()  # as after a reboot: the pool file stays
    assert not is_mount_point(settings.rw_dir)
    again = open_pool(settings)
    assert again is not None
    assert (settings.rw_dir / "sbx" / "kept").read_text() == "hello"
    assert (settings.layers_dir / "a-layer").is_dir()


def test_a_home_made_with_disks_keeps_them(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home", storage="auto")
    (settings.layers_dir / "sha256:old").mkdir(parents=True)
    assert open_pool(settings) is None
    assert not is_mount_point(settings.layers_dir)
    assert not (settings.home / "store.btrfs").exists()
    assert open_pool(Settings(home=tmp_path / "other", storage="ext4")) is None


def test_a_deleted_sandboxs_space_goes_back_to_the_host(
    pool: CowPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cowpool, "TRIM_AFTER", 1.0)
    d = pool.attach("sbx", 256)
    (d / "data").write_bytes(os.urandom(1 << 20) * 96)  # 96 MiB, not compressible
    os.sync()
    grown = pool.image.stat().st_blocks * 512
    pool.detach("sbx")

    def shrunk() -> bool:
        os.sync()
        return pool.image.stat().st_blocks * 512 < grown - (64 << 20)

    wait_until(shrunk, 30, 0.5, "the pool file to give the space back")
