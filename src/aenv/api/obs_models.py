"""E2B's response shapes of the observability routes: SandboxMetric, SandboxLogs (v1 and
v2), Node and NodeDetail (spec/openapi.yml of e2b-dev/E2B), plus a few fields of our own
(paused allocation, sandbox counts by state, the memory budget) where E2B has none."""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import Field

from aenv.domain import LIVE_STATES
from aenv.orchestrator import CLUSTER_ID, DiskInfo, LogEntry, MetricSample, NodeInfo

from .models import ListedSandbox, api_state
from .wire import ApiResponse


class SandboxMetric(ApiResponse):
    timestamp: datetime
    timestamp_unix: int = Field(alias="timestampUnix")
    cpu_count: int = Field(alias="cpuCount")
    cpu_used_pct: float = Field(alias="cpuUsedPct")
    mem_used: int = Field(alias="memUsed")
    mem_total: int = Field(alias="memTotal")
    mem_cache: int = Field(alias="memCache")
    disk_used: int = Field(alias="diskUsed")
    disk_total: int = Field(alias="diskTotal")

    @classmethod
    def of(cls, s: MetricSample) -> SandboxMetric:
        at = s.at if s.at.tzinfo is not None else s.at.replace(tzinfo=UTC)
        return cls(
            timestamp=at,
            timestampUnix=int(at.timestamp()),
            cpuCount=s.cpu_count,
            cpuUsedPct=s.cpu_used_pct,
            memUsed=s.mem_used,
            memTotal=s.mem_total,
            memCache=s.mem_cache,
            diskUsed=s.disk_used,
            diskTotal=s.disk_total,
        )


class SandboxesWithMetrics(ApiResponse):
    sandboxes: dict[str, SandboxMetric]


class SandboxLog(ApiResponse):
    timestamp: datetime
    line: str


class SandboxLogEntry(ApiResponse):
    timestamp: datetime
    level: str
    message: str
    fields: dict[str, str]

    @classmethod
    def of(cls, e: LogEntry) -> SandboxLogEntry:
        return cls(timestamp=e.at, level=e.level, message=e.message, fields=dict(e.fields))


class SandboxLogs(ApiResponse):
    logs: list[SandboxLog]
    log_entries: list[SandboxLogEntry] = Field(alias="logEntries")


class SandboxLogsV2(ApiResponse):
    logs: list[SandboxLogEntry]


class DiskMetrics(ApiResponse):
    mount_point: str = Field(alias="mountPoint")
    device: str
    filesystem_type: str = Field(alias="filesystemType")
    used_bytes: int = Field(alias="usedBytes")
    total_bytes: int = Field(alias="totalBytes")

    @classmethod
    def of(cls, d: DiskInfo) -> DiskMetrics:
        return cls(
            mountPoint=d.mount_point,
            device=d.device,
            filesystemType=d.filesystem_type,
            usedBytes=d.used_bytes,
            totalBytes=d.total_bytes,
        )


class NodeMetrics(ApiResponse):
    allocated_cpu: int = Field(alias="allocatedCPU")
    allocated_memory_bytes: int = Field(alias="allocatedMemoryBytes")
    cpu_percent: int = Field(alias="cpuPercent")
    memory_used_bytes: int = Field(alias="memoryUsedBytes")
    cpu_count: int = Field(alias="cpuCount")
    memory_total_bytes: int = Field(alias="memoryTotalBytes")
    disks: list[DiskMetrics]
    # No huge pages here (gVisor sandboxes do not use them).
    huge_pages_total: int = Field(default=0, alias="hugePagesTotal")
    huge_pages_used: int = Field(default=0, alias="hugePagesUsed")
    huge_pages_reserved: int = Field(default=0, alias="hugePagesReserved")
    huge_page_size_bytes: int = Field(default=0, alias="hugePageSizeBytes")
    # Ours: paused sandboxes' share (frozen ones still hold their memory on the host) and
    # the admission budget (AENV_MAX_MEMORY_MB).
    paused_cpu: int = Field(alias="pausedCPU")
    paused_memory_bytes: int = Field(alias="pausedMemoryBytes")
    memory_budget_bytes: int = Field(alias="memoryBudgetBytes")


class MachineInfo(ApiResponse):
    cpu_family: str = Field(alias="cpuFamily")
    cpu_model: str = Field(alias="cpuModel")
    cpu_model_name: str = Field(alias="cpuModelName")
    cpu_architecture: str = Field(alias="cpuArchitecture")


class Node(ApiResponse):
    """An item of `GET /nodes`."""

    id: str
    node_id: str = Field(alias="nodeID")
    service_instance_id: str = Field(alias="serviceInstanceID")
    cluster_id: str = Field(alias="clusterID")
    status: str
    status_changed_at: datetime = Field(alias="statusChangedAt")
    sandbox_count: int = Field(alias="sandboxCount")
    sandbox_starting_count: int = Field(alias="sandboxStartingCount")
    metrics: NodeMetrics
    create_successes: int = Field(alias="createSuccesses")
    create_fails: int = Field(alias="createFails")
    version: str
    commit: str
    machine_info: MachineInfo = Field(alias="machineInfo")
    # Ours: sandboxes by lifecycle state (`creating`, `running`, `paused`...) and paused
    # ones by tier (`paused_frozen`, `paused_hibernated`, `paused_files`).
    sandbox_counts: dict[str, int] = Field(alias="sandboxCounts")
    # Ours: the isolation backend (`gvisor`, `qemu`) and its accelerator (gVisor's platform,
    # `kvm` or `tcg` for QEMU).
    runtime: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def _fields(cls, n: NodeInfo) -> dict[str, object]:
        return {
            "id": n.node_id,
            "nodeID": n.node_id,
            "serviceInstanceID": n.service_instance_id,
            "clusterID": CLUSTER_ID,
            "status": n.status,
            "statusChangedAt": n.status_changed_at,
            "sandboxCount": n.running,
            "sandboxStartingCount": n.starting,
            "metrics": NodeMetrics(
                allocatedCPU=n.allocated_cpu,
                allocatedMemoryBytes=n.allocated_memory_bytes,
                cpuPercent=n.cpu_percent,
                memoryUsedBytes=n.memory_used_bytes,
                cpuCount=n.cpu_count,
                memoryTotalBytes=n.memory_total_bytes,
                disks=[DiskMetrics.of(d) for d in n.disks],
                pausedCPU=n.paused_cpu,
                pausedMemoryBytes=n.paused_memory_bytes,
                memoryBudgetBytes=n.memory_budget_bytes,
            ),
            "createSuccesses": n.create_successes,
            "createFails": n.create_fails,
            "version": n.version,
            "commit": "",
            "machineInfo": MachineInfo(**n.machine),
            "sandboxCounts": n.counts,
            "runtime": n.runtime,
        }

    @classmethod
    def of(cls, n: NodeInfo) -> Node:
        return cls(**cls._fields(n))  # type: ignore[arg-type]


class NodeDetail(Node):
    """`GET /nodes/{nodeID}`: the node and the sandboxes on it."""

    sandboxes: list[ListedSandbox]

    @classmethod
    def of(cls, n: NodeInfo) -> NodeDetail:
        listed = []
        for r in n.sandboxes:
            state = api_state(r)
            # Not the warm pool's (creating, for no one yet) nor the gone.
            if state is not None and r.state in LIVE_STATES:
                listed.append(ListedSandbox.from_record(r, state))
        return cls(**cls._fields(n), sandboxes=listed)  # type: ignore[arg-type]
