"""The node ahead of its sandboxes for the CPU: under full load the control plane must still
answer at once (a `/health`, a create's first steps), or every client times out together.

All sandboxes live in one cgroup parent per node (`cpu/<net prefix>/<container>`). In the
cgroup v1 CPU controller that parent competes with the node's own threads (in the root) as
one entity of weight `cpu.shares`: at a quarter of a plain process's weight the sandboxes,
all together, yield to the server whenever it has work, and use every core when it has
none. Nothing is capped; a sandbox's own `cpuCount` quota still applies within."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from .freezer import CGROUP_ROOT

log = logging.getLogger("aenv.runtime")

SANDBOX_SHARES = 256


def favour_node(prefix: str, root: Path = CGROUP_ROOT, shares: int = SANDBOX_SHARES) -> bool:
    """Gives the sandboxes' parent cgroup `shares` (made if missing); False without a cgroup
    v1 CPU controller (nothing changes then)."""
    cpu = root / "cpu"
    if not (cpu / "cpu.shares").exists():
        return False
    parent = cpu / prefix.strip("/")
    try:
        with contextlib.suppress(FileExistsError):
            parent.mkdir()
        (parent / "cpu.shares").write_text(str(shares))
    except OSError as e:
        log.warning("sandboxes' CPU weight not set: %s", e)
        return False
    return True
