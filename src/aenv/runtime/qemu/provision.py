"""What a VM needs before QEMU starts: its slot's namespace bridged to a tap, and its disks —
made for a new VM from the spec, or copied for a restored one from its image."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aenv.runtime import _proc
from aenv.runtime.base import SandboxSpec
from aenv.runtime.qemu import disks, image
from aenv.runtime.qemu.machine import Drive, Machine, config_script

_BRIDGE = (
    "link add br0 type bridge\n"
    "tuntap add dev tap0 mode tap\n"
    "link set eth0 master br0\n"
    "link set tap0 master br0\n"
    "address flush dev eth0\n"
    "link set br0 up\nlink set tap0 up\nlink set eth0 up\n"
)


async def bridge(inner_ns: str) -> None:
    """The slot's inner namespace as a guest needs it: its eth0 bridged to the VM's tap0, the
    address eth0 had left to the guest. `-force`: a reused slot has them already."""
    await _proc.run(
        ["ip", "-force", "-n", inner_ns, "-batch", "-"], input=_BRIDGE, check=False, time_limit=30
    )


async def files_for(images: disks.Images, m: Machine, spec: SandboxSpec) -> None:
    """A new VM's disks: the layers' image, the mounts', its own disk (holding the upper's
    files when the upper is not empty) and its config."""
    m.base = await images.of_stack(spec.layers)
    m.mounts = [
        Drive(f"aenv-m{i}", await images.of_dir(mnt.source), mnt.destination)
        for i, mnt in enumerate(spec.mounts)
    ]
    size = spec.disk_mb or disks.DISK_MB
    if spec.upper is not None and await asyncio.to_thread(_has_entries, spec.upper):
        await disks.disk_from_upper(spec.upper, m.disk, size)
    else:
        await disks.copy_file(await images.empty_disk(size), m.disk)
    await asyncio.to_thread(m.config_disk.write_bytes, config_script(spec, m.mounts))


async def files_from_image(m: Machine, image_dir: Path, record: image.ImageRecord) -> None:
    """A restored VM's disks: the image's own copies, the shared images it names."""
    m.base, m.mounts = record.base, list(record.mounts)
    m.cpu_count, m.memory_mb = record.cpu_count, record.memory_mb
    if record.memory_file:  # mapped privately: its pages shared until written
        m.ram, m.ram_shared = image_dir / image.MEMORY, False
    await asyncio.gather(
        asyncio.to_thread(disks.unpack, image_dir / image.DISK, m.disk),
        disks.copy_file(image_dir / image.CONFIG, m.config_disk),
    )


def _has_entries(d: Path) -> bool:
    return any(d.iterdir())
