"""The node's core behind one facade (`Orchestrator`); see facade.py for its parts. The
records its methods take and return are exported here with it: the layers above import
this package, never its modules (`tests/unit/test_import_layers.py`)."""

from .context import check_timeout
from .facade import Orchestrator
from .fork import ForkResult
from .logs import LEVELS, LogEntry
from .metrics import MetricSample
from .nodeinfo import CLUSTER_ID, DiskInfo, NodeInfo

__all__ = [
    "CLUSTER_ID",
    "LEVELS",
    "DiskInfo",
    "ForkResult",
    "LogEntry",
    "MetricSample",
    "NodeInfo",
    "Orchestrator",
    "check_timeout",
]
