"""The node's core: `Orchestrator` builds it and exposes its parts (see facade.py). The parts'
types and the records their methods take and return are exported here with it: the layers
above import this package, never its modules (`tests/unit/test_import_layers.py`)."""

from .context import NodeContext, check_timeout
from .diffs import FORK_POINT, Applied, TreeDiffs
from .eventrecords import (
    EVENT_TYPES,
    KILLED,
    TEAM_ID,
    Delivery,
    LifecycleEvent,
    Webhook,
    WebhookStats,
    signature,
)
from .events import MAX_LIMIT as MAX_EVENTS_LIMIT
from .events import Events
from .facade import Orchestrator
from .fork import Forker, ForkResult
from .idle import IdleTracker
from .lineage import Ancestor, Descendant, LineageTree, lineage_tree
from .liveness import Liveness
from .logs import LEVELS, LogEntry, SandboxLogs
from .metrics import MetricSample, SandboxMetrics
from .moving import DrainResult, Mover
from .node import Node
from .nodeinfo import CLUSTER_ID, DiskInfo, NodeInfo, NodeStats
from .pausing import Pauser
from .rollback import Rollbacks
from .sampling import Sampler
from .sandboxes import Sandboxes
from .snapshots import Snapshotter
from .table import SandboxTable
from .templates import TemplateRegistry
from .volumes import Volumes

__all__ = [
    "FORK_POINT",
    "Applied",
    "TreeDiffs",
    "Rollbacks",
    "Ancestor",
    "Descendant",
    "LineageTree",
    "lineage_tree",
    "CLUSTER_ID",
    "EVENT_TYPES",
    "KILLED",
    "MAX_EVENTS_LIMIT",
    "TEAM_ID",
    "Delivery",
    "Events",
    "LifecycleEvent",
    "Webhook",
    "WebhookStats",
    "signature",
    "LEVELS",
    "DiskInfo",
    "DrainResult",
    "ForkResult",
    "Forker",
    "IdleTracker",
    "Liveness",
    "LogEntry",
    "MetricSample",
    "Mover",
    "Node",
    "NodeContext",
    "NodeInfo",
    "NodeStats",
    "Orchestrator",
    "Pauser",
    "SandboxLogs",
    "SandboxMetrics",
    "SandboxTable",
    "Sampler",
    "Sandboxes",
    "Snapshotter",
    "TemplateRegistry",
    "Volumes",
    "check_timeout",
]
