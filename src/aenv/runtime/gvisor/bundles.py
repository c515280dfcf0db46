"""Bundle dirs, one per container: `<sandboxes_dir>/<sandbox_id>/<container_id>/` holds
config.json (the OCI spec), instance.json (the `Container`), rootfs/ (the host overlay's
mount point), console.log and runsc's logs."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

from aenv.runtime import rootfs
from aenv.runtime.gvisor.container import INSTANCE_FILE, Container

log = logging.getLogger("aenv.runtime")

ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,100}")
_MARKERS = (INSTANCE_FILE, "config.json")


def make(c: Container, fresh: bool) -> None:
    """Creates the bundle dir (or, for a stopped container started again, reuses it) and
    writes instance.json."""
    c.bundle_dir.mkdir(parents=True, exist_ok=not fresh)
    (c.bundle_dir / "config.json").unlink(missing_ok=True)
    c.save()


def write_config(bundle: Path, cfg: dict[str, Any]) -> None:
    (bundle / "config.json").write_text(json.dumps(cfg, indent=1))


def remove(bundle: Path) -> None:
    """Removes a bundle dir, unless something is still mounted below it (a recursive delete
    through a rootfs overlay would delete the sandbox's files in its upper dir)."""
    if not bundle.is_dir() or bundle.is_symlink():
        return
    if rootfs.mount_points(bundle) or rootfs.is_mount_point(bundle):
        log.warning("not removing %s: something is still mounted below it", bundle)
        return
    shutil.rmtree(bundle, ignore_errors=True)
    with contextlib.suppress(OSError):
        bundle.parent.rmdir()  # the sandbox dir, when this was its last container


def find_stopped(root: Path, cid: str) -> Container | None:
    """A stopped container's record from its bundle dir, or None."""
    if not ID_RE.fullmatch(cid) or not root.is_dir():
        return None
    for bundle in root.glob(f"*/{cid}"):
        c = Container.load(bundle)
        if c is not None and c.id == cid and c.bundle_dir == bundle and c.stopped:
            return c
    return None


def cleanup(root: Path, keep: set[str]) -> int:
    """Removes bundle dirs (and the overlay work dirs they name) of containers not in
    `keep`, and empty sandbox dirs. Mounts below must be gone (see `reconcile`)."""
    removed = 0
    if not root.is_dir():
        return 0
    for sandbox_dir in root.iterdir():
        if not sandbox_dir.is_dir() or sandbox_dir.is_symlink():
            continue
        for bundle in sandbox_dir.iterdir():
            if (
                bundle.name not in keep
                and bundle.is_dir()
                and not bundle.is_symlink()
                and any((bundle / m).exists() for m in _MARKERS)
            ):
                c = Container.load(bundle)
                work = c.workdir if c is not None else None
                if work is not None and work.name == f"work-{bundle.name}":
                    rootfs.remove_work_dir(work)
                remove(bundle)
                removed += 1
        with contextlib.suppress(OSError):
            sandbox_dir.rmdir()
    return removed
