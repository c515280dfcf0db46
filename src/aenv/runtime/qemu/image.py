"""A QEMU checkpoint image: the directory `checkpoint` writes and `restore` reads.

    state        QEMU's migration stream: device state, and the RAM unless it was a file
    memory       the RAM as a file (when the VM's RAM was a file of its own)
    disk.packed  the guest's own disk at that instant, its written extents only
    config.img   its config disk
    qemu.json    this record, written last: an image without it is not complete

The record names the read-only images the guest had attached (they stay where they are,
shared, on this node) and the machine's shape: a restore must describe the same machine.
Another backend's image (`runtime/checkpoints.py`), or one of another accelerator, is refused.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aenv.errors import RuntimeFailure
from aenv.runtime import checkpoints
from aenv.runtime.qemu.machine import Drive, Machine

RECORD = "qemu.json"
STATE, MEMORY, DISK, CONFIG = "state", "memory", "disk.packed", "config.img"


@dataclass(frozen=True)
class ImageRecord:
    accel: str
    base: Path
    cpu_count: int
    memory_mb: int
    # True: RAM in `memory` (saved with `x-ignore-shared`); False: in the stream.
    memory_file: bool
    mounts: list[Drive] = field(default_factory=list)

    @classmethod
    def of(cls, m: Machine) -> ImageRecord:
        return cls(m.accel, m.base, m.cpu_count, m.memory_mb, m.ram_shared, list(m.mounts))

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["base"] = str(self.base)
        d["mounts"] = [{**m, "path": str(m["path"])} for m in d["mounts"]]
        return json.dumps({"backend": "qemu", **d})

    @classmethod
    def from_json(cls, text: str) -> ImageRecord:
        d: dict[str, Any] = json.loads(text)
        if d.get("backend") != "qemu":
            raise ValueError("not a qemu image")
        return cls(
            accel=str(d["accel"]),
            base=Path(d["base"]),
            cpu_count=int(d["cpu_count"]),
            memory_mb=int(d["memory_mb"]),
            memory_file=bool(d["memory_file"]),
            mounts=[Drive(m["serial"], Path(m["path"]), m["destination"]) for m in d["mounts"]],
        )


def complete(image_dir: Path) -> bool:
    """A record, and every file it implies (a copy of an image may have lost one)."""
    try:
        record = ImageRecord.from_json((image_dir / RECORD).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return False
    files = [STATE, DISK, CONFIG, *([MEMORY] if record.memory_file else [])]
    return all((image_dir / f).is_file() for f in files)


def read(image_dir: Path, accel: str) -> ImageRecord:
    """The image's record, checked to be whole, QEMU's and restorable under `accel`, with
    every shared image it names present on this node."""
    checkpoints.refuse_foreign(image_dir, "qemu")
    if not complete(image_dir):
        raise RuntimeFailure(f"no complete qemu checkpoint image at {image_dir}")
    record = ImageRecord.from_json((image_dir / RECORD).read_text())
    if record.accel != accel:
        raise RuntimeFailure(
            f"image {image_dir} was made under {record.accel}; this node runs {accel}"
        )
    for p in (record.base, *(d.path for d in record.mounts)):
        if not p.exists():
            raise RuntimeFailure(f"image {image_dir} needs {p}, which this node lacks")
    return record
