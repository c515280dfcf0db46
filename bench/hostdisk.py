"""A snapshot's memory image on the host's disk, for a server the bench started itself (its
AENV_HOME is known): the API answers a snapshot with its id and Server-Timing stages, not its
size, so the size is read host-side like hostproc.py reads memory. The catalog
(`$AENV_HOME/catalog.db`, SQLite, table `templates`: `id`, `doc` JSON) names the snapshot's
checkpoint image; the image is the directory `$AENV_HOME/images/<checkpoint>`."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from pathlib import Path


def checkpoint_of(home: Path, snapshot_id: str) -> str | None:
    """The `checkpoint` field of the snapshot's catalog document (None: no such snapshot,
    no image, or no catalog)."""
    db = home / "catalog.db"
    if not db.is_file():
        return None
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5.0)
    except sqlite3.Error:
        return None
    try:
        row = conn.execute("SELECT doc FROM templates WHERE id=?", (snapshot_id,)).fetchone()
    except sqlite3.Error:
        return None
    finally:
        conn.close()
    if row is None:
        return None
    try:
        doc = json.loads(row[0])
    except (TypeError, ValueError):
        return None
    value = doc.get("checkpoint") if isinstance(doc, dict) else None
    return str(value) if value else None


def dir_bytes(path: Path) -> int | None:
    """Sum of the apparent sizes of the regular files below `path` (None: not a directory).
    Hard links to one file count once."""
    if not path.is_dir():
        return None
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(root, name))
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
                total += st.st_size
    return total


def snapshot_image_mib(home: Path, snapshot_id: str) -> float | None:
    """The snapshot's memory image size in MiB (None when it cannot be found)."""
    checkpoint = checkpoint_of(home, snapshot_id)
    if checkpoint is None or "/" in checkpoint or checkpoint in (".", ".."):
        return None
    size = dir_bytes(home / "images" / checkpoint)
    return None if size is None else size / (1 << 20)
