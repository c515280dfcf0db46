"""Which backend made a checkpoint image. Each writes files of its own (gVisor's
`checkpoint.img`, QEMU's `qemu.json`), so a node refuses another backend's image by name, before
its own restore fails on it in some less telling way. Snapshots in the repository keep their
image's files as they are, so a snapshot says which backend made it wherever it goes."""

from __future__ import annotations

from pathlib import Path

from aenv.errors import RuntimeFailure

MARKERS = {"checkpoint.img": "gvisor", "qemu.json": "qemu"}


def made_by(image_dir: Path) -> str | None:
    """The backend whose image `image_dir` holds (whole or not), None when none's."""
    for name, backend in MARKERS.items():
        if (image_dir / name).exists():
            return backend
    return None


def refuse_foreign(image_dir: Path, mine: str) -> None:
    other = made_by(image_dir)
    if other is not None and other != mine:
        raise RuntimeFailure(
            f"the checkpoint image at {image_dir} was made by the {other} backend; this node "
            f"runs {mine}"
        )
