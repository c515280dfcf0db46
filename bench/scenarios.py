"""The rows measured through a server's HTTP API (see bench/README.md for each definition):
`ServerRows` has them all, from `scenarios_lifecycle.py` (one sandbox's operations),
`scenarios_forktree.py` (diff, apply, rollback) and `scenarios_scale.py` (many sandboxes at
once), on the shared parts in `scenarios_common.py`.
"""

from __future__ import annotations

from .scenarios_common import (
    POOL_REFILL_WAIT,
    PROBE_ID,
    SETTLE_TIMEOUT,
    RowsBase,
    SampleFn,
    sample_loop,
    wait_until,
)
from .scenarios_forktree import ForkTreeRows
from .scenarios_lifecycle import (
    CMDS_MIB_ROW,
    CMDS_ROW,
    DIRTY_MEMORY_MB,
    LifecycleRows,
    cmds_command,
    dirty_command,
    reports_hibernated,
)
from .scenarios_scale import CONCURRENT_MEMORY_MB, FILLER_MEMORY_MB, ScaleRows

__all__ = [
    "CMDS_MIB_ROW",
    "CMDS_ROW",
    "CONCURRENT_MEMORY_MB",
    "DIRTY_MEMORY_MB",
    "FILLER_MEMORY_MB",
    "POOL_REFILL_WAIT",
    "PROBE_ID",
    "SETTLE_TIMEOUT",
    "RowsBase",
    "SampleFn",
    "ServerRows",
    "cmds_command",
    "dirty_command",
    "reports_hibernated",
    "sample_loop",
    "wait_until",
]


class ServerRows(LifecycleRows, ForkTreeRows, ScaleRows):
    """Every row of one server."""
