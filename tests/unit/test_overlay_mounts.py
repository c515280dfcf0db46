"""The host overlays a sandbox runs on, mounted with mount(2) by the node itself: a writable
one puts what is written into its upper, the shared read-only stack refuses writes, and
both carry nosuid,nodev; a stack too long for absolute paths still mounts."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest

from aenv.runtime import _proc, rootfs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")


def _options(target: Path) -> set[str]:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[1] == str(target):
            return set(fields[3].split(","))
    raise AssertionError(f"{target} is not mounted")


def _layers(tmp: Path, n: int) -> list[Path]:
    out = []
    for i in range(n):
        layer = tmp / f"layer-{i:03d}"
        layer.mkdir()
        (layer / f"from-{i}").write_text(str(i))
        out.append(layer)
    return out


def test_a_writable_overlay_writes_into_its_upper(tmp_path: Path) -> None:
    layers = _layers(tmp_path, 2)
    upper, work, target = tmp_path / "upper", tmp_path / "work", tmp_path / "mnt"
    upper.mkdir()
    asyncio.run(rootfs.mount_writable(layers, upper, work, target))
    try:
        assert (target / "from-0").read_text() == "0" and (target / "from-1").read_text() == "1"
        (target / "new").write_text("written")
        assert (upper / "new").read_text() == "written"
        assert {"rw", "nosuid", "nodev"} <= _options(target)
    finally:
        assert _proc.umount(str(target)) == 0


def test_the_shared_stack_is_read_only(tmp_path: Path) -> None:
    layers = _layers(tmp_path, 3)
    mounts = rootfs.RootfsMounts(tmp_path / "stacks")

    async def go() -> None:
        root, key = await mounts.acquire(layers, "owner-1")
        try:
            assert {"ro", "nosuid", "nodev"} <= _options(root)
            assert (root / "from-2").read_text() == "2"
            with pytest.raises(OSError) as err:
                (root / "new").write_text("x")
            assert err.value.errno == errno.EROFS
        finally:
            await mounts.release(key, "owner-1")
        assert not rootfs.mount_points(tmp_path / "stacks")

    asyncio.run(go())


def test_a_long_stack_mounts_with_relative_lowerdirs(tmp_path: Path) -> None:
    # Absolute paths of these layers do not fit one page of mount options.
    deep = tmp_path / ("d" * 200) / ("e" * 200)
    deep.mkdir(parents=True)
    layers = _layers(deep, 20)
    upper, work, target = tmp_path / "upper", tmp_path / "work", tmp_path / "mnt"
    upper.mkdir()
    assert len(":".join(map(str, layers))) > 4096
    asyncio.run(rootfs.mount_writable(layers, upper, work, target))
    try:
        assert (target / "from-19").read_text() == "19"
    finally:
        assert _proc.umount(str(target)) == 0
