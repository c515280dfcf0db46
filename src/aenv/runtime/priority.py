"""The node ahead of its sandboxes for the CPU: under full load the control plane must still
answer at once (a `/health`, a create's first steps), or every client times out together.

The node process runs at nice NODE_NICE (`raise_node`, at start, before any thread: threads
and children inherit it); the commands it starts (runsc and the rest, `runtime/_proc.py`)
go back to nice 0 (`as_work`) right after they start, so they do not share its priority.

All sandboxes live in one cgroup parent per node (`cpu/<net prefix>/<container>`). In the
cgroup v1 CPU controller that parent competes with the node's own threads (in the root) as
one entity of weight `cpu.shares`: at a quarter of a plain process's weight the sandboxes,
all together, yield to the server whenever it has work, and use every core when it has
none. Nothing is capped; a sandbox's own `cpuCount` quota still applies within."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from .freezer import CGROUP_ROOT

log = logging.getLogger("aenv.runtime")

SANDBOX_SHARES = 256
NODE_NICE = -10
AUTOGROUP = Path("/proc/self/autogroup")


def raise_node(autogroup: Path = AUTOGROUP) -> None:
    """This process (and the threads and children it makes from now on) at NODE_NICE, and
    its session's autogroup too where the kernel groups by session: there a nice counts only
    inside the group, and each runsc command (a session of its own) is a group as heavy as
    the whole node unless the node's group is raised."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, NODE_NICE)
    except OSError as e:  # not root: as before
        log.debug("node priority not raised: %s", e)
    if autogroup.exists():
        try:
            autogroup.write_text(str(NODE_NICE))
        except OSError as e:
            log.debug("node autogroup not raised: %s", e)


def as_work(pid: int) -> None:
    """A command the node started back at the default priority."""
    with contextlib.suppress(OSError):
        if os.getpriority(os.PRIO_PROCESS, 0) < 0:
            os.setpriority(os.PRIO_PROCESS, pid, 0)


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
