"""What the node tells about itself: the E2B `Node` view (capacity, allocation, usage,
sandbox counts, create counters, status) and the Prometheus registry of its operations
(latency histograms and error counters per operation, sandboxes by state, cache sizes),
its HTTP requests, process and build (`aenv.telemetry`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import socket
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .. import __version__
from ..domain import HOLDS_MEMORY, SandboxRecord, SandboxState
from ..errors import AenvError
from ..logctx import sandbox_context
from ..telemetry import HttpMetrics, register_process_and_build
from .durable import Durable
from .storage import SandboxStorage
from .table import SandboxTable

# The one cluster a single node is part of (E2B's field is a UUID).
CLUSTER_ID = "00000000-0000-0000-0000-000000000000"
MIB = 1024 * 1024
# Lifecycle operations take from milliseconds (pause) to minutes (a big fork).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class DiskInfo:
    mount_point: str
    device: str
    filesystem_type: str
    used_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    service_instance_id: str
    status: str  # ready | draining
    status_changed_at: datetime
    version: str
    cpu_count: int
    cpu_percent: int
    memory_total_bytes: int
    memory_used_bytes: int
    memory_budget_bytes: int
    allocated_cpu: int
    allocated_memory_bytes: int
    paused_cpu: int
    paused_memory_bytes: int
    disks: list[DiskInfo]
    machine: dict[str, str]
    # The isolation backend and what runs its sandboxes (`Runtime.describe`).
    runtime: dict[str, str]
    # Internal states (creating, running, paused...) and pause tiers (paused_frozen...).
    counts: dict[str, int]
    create_successes: int
    create_fails: int
    sandboxes: list[SandboxRecord] = field(default_factory=list)

    @property
    def running(self) -> int:
        return self.counts.get(SandboxState.RUNNING.value, 0)

    @property
    def starting(self) -> int:
        return self.counts.get(SandboxState.CREATING.value, 0)


class NodeStats:
    """Counters and histograms of the node's operations, and the node's own view."""

    def __init__(
        self,
        table: SandboxTable,
        home: Path,
        is_closing: Callable[[], bool],
        cache_sizes: Callable[[], dict[str, int]] | None = None,
        runtime: Callable[[], dict[str, str]] | None = None,
    ) -> None:
        self.table = table
        self.home = home
        self.is_closing = is_closing
        self.cache_sizes = cache_sizes or (lambda: {})
        self.runtime = runtime or (lambda: {})
        self.node_id = socket.gethostname().split(".")[0] or "aenv"
        self.service_instance_id = ""
        self.started_at = datetime.now(UTC)
        self.create_successes = 0
        self.create_fails = 0
        self._status = ("ready", self.started_at)
        self._cpu: tuple[int, int] | None = None
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.latency = Histogram(
            # `_duration_seconds`, like every latency histogram of ours (was
            # `aenv_operation_seconds`).
            "aenv_operation_duration_seconds",
            "Duration of sandbox lifecycle operations that succeeded",
            ["op"],
            buckets=BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "aenv_operation_errors",
            "Sandbox lifecycle operations that failed, by HTTP status of the error",
            ["op", "code"],
            registry=r,
        )
        self.oom_kills = Counter(
            "aenv_sandbox_oom_kills",
            "Processes killed inside sandboxes that used more memory than their size",
            registry=r,
        )
        self._by_state = Gauge("aenv_sandboxes", "Sandboxes on the node", ["state"], registry=r)
        self._mem = Gauge(
            "aenv_memory_allocated_bytes", "memoryMB of sandboxes holding memory", registry=r
        )
        self._budget = Gauge("aenv_memory_budget_bytes", "The admission budget", registry=r)
        self._cache = Gauge("aenv_cache_bytes", "Node caches' size on disk", ["cache"], registry=r)
        # The API's requests (counted by the app's middleware), the process and the build:
        # here, so the node's one registry is whole however often an app is built over it.
        self.http = HttpMetrics(r)
        register_process_and_build(r)

    # ---------------------------------------------------------------- operations
    @contextlib.contextmanager
    def observe(self, op: str, sandbox_id: str | None = None) -> Iterator[None]:
        """Times one operation (about `sandbox_id`: its log lines carry the id)."""
        t0 = time.perf_counter()
        # A context even without an id: what the operation learns (`logctx.about`) ends
        # with it.
        with sandbox_context(sandbox_id):
            try:
                yield
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                code = e.status if isinstance(e, AenvError) else 500
                self.errors.labels(op, str(code)).inc()
                # A client's mistake (bad template, bad body) is no failure of the node;
                # being full is.
                if op == "create" and (code >= 500 or code == 429):
                    self.create_fails += 1
                raise
            self.latency.labels(op).observe(time.perf_counter() - t0)
            if op == "create":
                self.create_successes += 1

    # ---------------------------------------------------------------- the node view
    def status(self) -> tuple[str, datetime]:
        want = "draining" if self.is_closing() else "ready"
        if self._status[0] != want:
            self._status = (want, datetime.now(UTC))
        return self._status

    async def info(self, *, with_sandboxes: bool = False) -> NodeInfo:
        """The node now."""
        # It reads /proc and statvfs: off the event loop.
        return await asyncio.to_thread(self._info, with_sandboxes)

    def _info(self, with_sandboxes: bool) -> NodeInfo:
        records = self.table.all()
        counts: Tally[str] = Tally(r.state.value for r in records)
        for r in records:
            if r.tier is not None:
                counts[f"paused_{r.tier.value}"] += 1
        alloc = [r for r in records if r.state in HOLDS_MEMORY]
        paused = [r for r in records if r.state is SandboxState.PAUSED]
        mem = _meminfo()
        total = mem.get("MemTotal", 0)
        used = max(0, total - mem.get("MemAvailable", mem.get("MemFree", 0)))
        status, changed = self.status()
        return NodeInfo(
            node_id=self.node_id,
            service_instance_id=self.service_instance_id,
            status=status,
            status_changed_at=changed,
            version=__version__,
            cpu_count=os.cpu_count() or 1,
            cpu_percent=self._cpu_percent(),
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_budget_bytes=self.table.memory_budget_mb * MIB,
            allocated_cpu=sum(r.cpu_count for r in alloc),
            allocated_memory_bytes=sum(r.memory_mb for r in alloc) * MIB,
            paused_cpu=sum(r.cpu_count for r in paused),
            paused_memory_bytes=sum(r.memory_mb for r in paused) * MIB,
            disks=[d for d in [_disk(self.home)] if d is not None],
            machine=_machine(),
            runtime=self.runtime(),
            counts=dict(counts),
            create_successes=self.create_successes,
            create_fails=self.create_fails,
            sandboxes=records if with_sandboxes else [],
        )

    def _cpu_percent(self) -> int:
        """Host CPU use since the previous call (since boot at the first)."""
        try:
            with open("/proc/stat", encoding="ascii") as f:
                vals = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return 0
        busy, total = sum(vals) - vals[3] - vals[4], sum(vals)
        prev, self._cpu = self._cpu, (busy, total)
        if prev is not None and total > prev[1]:
            busy, total = busy - prev[0], total - prev[1]
        return round(100 * busy / total) if total > 0 else 0

    # ---------------------------------------------------------------- Prometheus
    async def exposition(self) -> bytes:
        """The node's Prometheus text exposition."""
        # It reads caches' sizes on disk: off the event loop.
        return await asyncio.to_thread(self._exposition)

    def _exposition(self) -> bytes:
        records = self.table.all()
        counts = Tally(r.state.value for r in records)
        for state in SandboxState:
            self._by_state.labels(state.value).set(counts.get(state.value, 0))
        self._mem.set(sum(r.memory_mb for r in records if r.state in HOLDS_MEMORY) * MIB)
        self._budget.set(self.table.memory_budget_mb * MIB)
        for name, size in self.cache_sizes().items():
            self._cache.labels(name).set(size)
        return generate_latest(self.registry)


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def _disk(path: Path) -> DiskInfo | None:
    """The filesystem holding `path` (the node's home: layers, disks, images)."""
    try:
        sv = os.statvfs(path)
    except OSError:
        return None
    best = ("", "", "")
    with contextlib.suppress(OSError):
        real = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = (line.split() + ["", "", ""])[:3]
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype)
    return DiskInfo(
        mount_point=best[1] or str(path),
        device=best[0],
        filesystem_type=best[2],
        used_bytes=(sv.f_blocks - sv.f_bfree) * sv.f_frsize,
        total_bytes=sv.f_blocks * sv.f_frsize,
    )


def _machine() -> dict[str, str]:
    info = {"cpu family": "", "model": "", "model name": ""}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in info and not info[key]:
                info[key] = value.strip()
            if all(info.values()):
                break
    return {
        "cpuFamily": info["cpu family"],
        "cpuModel": info["model"],
        "cpuModelName": info["model name"],
        "cpuArchitecture": platform.machine(),
    }


def cache_sizes(storage: SandboxStorage, durable: Durable | None) -> Callable[[], dict[str, int]]:
    """Bytes on disk of the layer store and of the cache of fetched memory images."""
    refs = storage.refs

    def sizes() -> dict[str, int]:
        out = {"layers": refs.usage()}
        if durable is not None:
            out["snapshot_images"] = durable.store.cache.usage()
        return out

    return sizes
