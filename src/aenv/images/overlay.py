"""The overlayfs layer format, read from the host: a 0/0 character device is a whiteout, an
opaque directory (`trusted.overlay.opaque=y`) hides what lies below it, and a path is what
the topmost layer (of a stack given topmost first) that has it says."""

from __future__ import annotations

import os
import stat
from pathlib import Path

OPAQUE = "trusted.overlay.opaque"


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def is_opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def lookup(layers: list[Path], rel: str) -> tuple[Path, os.stat_result] | None:
    """Where `rel` ("etc/passwd") is in the merged stack and its stat; None if absent."""
    parts = [p for p in rel.split("/") if p]
    for layer in layers:
        hidden_below = False
        blocked = False
        cur = layer
        for part in parts[:-1]:
            cur = cur / part
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                break
            except OSError:
                blocked = True
                break
            if not stat.S_ISDIR(st.st_mode):
                blocked = True  # whiteout or a file where a directory is wanted
                break
            if is_opaque(cur):
                hidden_below = True
        if blocked:
            return None
        target = layer.joinpath(*parts)
        try:
            found = os.lstat(target)
        except OSError:
            found = None
        if found is not None:
            return None if is_whiteout(found) else (target, found)
        if hidden_below:
            return None
    return None
