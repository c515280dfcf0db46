"""Per-sandbox disks on real loop-mounted ext4 images (root only): the size holds, files
survive a remount, spares are used, and nothing is left after detach."""

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
from aenv.runtime.storage.disks import Disks

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mkfs.ext4") is None,
    reason="loop mounts need root and mkfs.ext4",
)


@pytest.fixture
def disks(tmp_path: Path) -> Iterator[Disks]:
    d = Disks(tmp_path / "disks", tmp_path / "rw", spares=1)
    try:
        yield d
    finally:
        for sandbox_id in d.owners():
            d.detach(sandbox_id)


def fill(path: Path, mib: int) -> int:
    """Writes up to `mib` MiB; returns the errno that stopped it (0: all written)."""
    chunk = b"x" * 2**20
    try:
        with open(path, "wb") as f:
            for _ in range(mib):
                f.write(chunk)
                f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e.errno or -1
    return 0


def test_a_disk_stops_writes_at_its_size(disks: Disks) -> None:
    mnt = disks.attach("sbx1", 16)
    assert is_mount_point(mnt)
    assert os.statvfs(mnt).f_blocks * os.statvfs(mnt).f_frsize <= 16 * 2**20
    assert fill(mnt / "big", 64) == errno.ENOSPC
    other = disks.attach("sbx2", 16)
    assert fill(other / "small", 4) == 0  # one full disk leaves the others alone


def test_files_survive_a_remount_and_detach_removes_everything(disks: Disks) -> None:
    mnt = disks.attach("sbx1", 16)
    (mnt / "kept").write_text("hello")
    subprocess.run(["umount", str(mnt)], check=True)  # as after a reboot: image kept
    assert not is_mount_point(mnt)
    assert disks.attach("sbx1", 16) == mnt
    assert (mnt / "kept").read_text() == "hello"
    assert disks.attach("sbx1", 16) == mnt  # idempotent
    assert disks.owners() == {"sbx1"}

    disks.detach("sbx1")
    assert not is_mount_point(mnt)
    assert not disks.image("sbx1").exists()
    assert disks.owners() == set()


def test_spares_are_formatted_ahead_and_taken(disks: Disks) -> None:
    disks.refill(16)
    spares = sorted(disks.images_dir.glob("spare-*"))
    assert len(spares) == 1
    disks.attach("sbx1", 16)
    assert not spares[0].exists()  # renamed into the sandbox's image
    assert disks.image("sbx1").exists()
    disks.refill(32)  # another size: the old spares go, new ones come
    assert [p.stat().st_size for p in disks.images_dir.glob("spare-*")] == [32 * 2**20]


def test_storage_puts_uppers_on_disks_and_sweeps_orphans_with_theirs(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, default_disk_mb=16, disk_spares=0)
    storage = SandboxStorage(settings, LayerStore(settings))
    assert storage.disks is not None
    for sandbox_id in ("kept", "orphan"):
        upper = storage.first_upper(sandbox_id)
        storage.ensure_upper(sandbox_id, upper, 16)
        assert is_mount_point(settings.rw_dir / sandbox_id) and upper.is_dir()
    (storage.first_upper("kept") / "f").write_text("x")
    # The layer store is another filesystem: sealing copies the upper out of the disk.
    digest = storage.seal(storage.first_upper("kept"), "kept")
    assert (storage.layers.path(digest) / "f").read_text() == "x"
    try:
        # A crash left "orphan" (no record): the start-up sweep takes its disk as well.
        removed = storage.sweep_uppers({"kept": (str(storage.new_upper("kept")), None)})
        assert removed >= 1
        assert storage.disks.owners() == {"kept"}
        assert not (settings.rw_dir / "orphan").exists()
        assert is_mount_point(settings.rw_dir / "kept")
    finally:
        storage.remove_sandbox("kept")
        storage.remove_sandbox("orphan")
    assert storage.disks.owners() == set()
