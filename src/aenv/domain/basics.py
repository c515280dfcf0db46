"""Ids, timings, states and the small records the sandbox and template records hold."""

from __future__ import annotations

import contextlib
import enum
import re
import secrets
import string
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..egress import EgressPolicy

# The port envd listens on inside every sandbox (E2B's).
ENVD_PORT = 49983
# The template a create names none of: Debian with envd (`make run` builds it).
DEFAULT_TEMPLATE = "base"

_ID_ALPHABET = string.ascii_lowercase + string.digits
# Characters a Server-Timing metric name (an HTTP token) cannot hold.
_TOKEN_UNSAFE = re.compile(r"[^A-Za-z0-9!#$%&'*+.^_`|~-]")


def new_id(prefix: str = "i") -> str:
    """E2B-style: 20 lowercase alphanumerics; no '-' so `{port}-{id}.{domain}` parses."""
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(20 - len(prefix)))


def utcnow() -> datetime:
    return datetime.now(UTC)


class Timings:
    """Stage durations of one lifecycle operation, for the `Server-Timing` header."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stages[name] = self.stages.get(name, 0.0) + (time.perf_counter() - t0) * 1000

    def header(self) -> str:
        """`name;dur=12.3, other;dur=4.0` (names made HTTP tokens); empty if no stage ran."""
        return ", ".join(
            f"{_TOKEN_UNSAFE.sub('_', name) or 'step'};dur={float(ms):.1f}"
            for name, ms in self.stages.items()
        )


class SandboxState(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    KILLING = "killing"
    KILLED = "killed"
    # The server restarted and could not recover a sandbox that was running.
    LOST = "lost"


# States in which a sandbox exists for its user (listed, reachable, resumable).
LIVE_STATES = frozenset(
    {SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.PAUSING, SandboxState.RESUMING}
)
# States in which a sandbox counts against the node's memory budget.
HOLDS_MEMORY = frozenset(
    {SandboxState.CREATING, SandboxState.RUNNING, SandboxState.PAUSING, SandboxState.RESUMING}
)


class PauseTier(enum.StrEnum):
    """Where a paused sandbox's state lives."""

    # The container is frozen in place: CPU released, memory kept; resume = thaw.
    FROZEN = "frozen"
    # Memory + processes checkpointed to an image, container released; resume = restore.
    HIBERNATED = "hibernated"
    # Only the files are kept (E2B `memory: false`); resume = a fresh boot on them.
    FILES = "files"


@dataclass
class PausedState:
    tier: PauseTier
    paused_at: datetime
    # The memory image of a hibernated sandbox (its name in the node's image store).
    image: str | None = None
    # The hibernation (files, image and record) is in the repository: with a shared one,
    # another node can resume the sandbox (cluster failover, drain).
    published: bool = False
    # Put on disk by the node from standby (`orchestrator/idle.py`), not by its user: to
    # its user it is still running, and its next request resumes it.
    standby: bool = False


@dataclass
class PendingOp:
    """An operation on a sandbox that a crash of the server could cut short: stored with the
    record before its first step that changes the host, cleared when its last step is saved,
    so start-up recovery knows what it was doing (see `orchestrator/recovery.py`)."""

    # "snapshot", "fork" or "hibernate".
    kind: str
    # The memory image the operation writes (its name in the node's image store).
    image: str | None = None
    # The digest the sandbox's upper is sealed under (chosen before the seal, so a crash
    # between moving the upper into the layer store and saving the record loses nothing).
    layer: str | None = None


@dataclass
class Instance:
    """A sandbox as its runtime backend runs it: an opaque handle. The orchestrator reads
    only `sandbox_id`, `id` and `address`; `data` belongs to the backend that made it."""

    sandbox_id: str
    # The backend's name for this incarnation (a new one after every restore).
    id: str
    # The host address through which every port of the sandbox is reachable.
    address: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Upstream:
    """Where the data plane sends one request for a sandbox's port."""

    host: str
    port: int
    # The Host header the sandbox sees instead of the client's (E2B's `maskRequestHost`).
    host_header: str | None = None


@dataclass
class BootInfo:
    """What a sandbox inherited from its template, for every later boot of it."""

    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    workdir: str | None = None
    # The template's own layers (a sandbox restored from a boot snapshot runs on more).
    from_layers: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class MountRequest:
    """A volume a create asks for, by name (E2B's `volumeMounts` item)."""

    name: str
    path: str
    read_only: bool = False


@dataclass(frozen=True)
class VolumeMount:
    """A volume mounted into a sandbox, at `path`, for every boot of it (resume, restore,
    snapshot, fork children). By id: a volume re-created under the same name is another."""

    volume_id: str
    name: str
    path: str
    read_only: bool = False


@dataclass(frozen=True)
class Quota:
    """What one API key's sandboxes may hold on a node at once (None: no limit): sandboxes
    holding memory (running or frozen) and the sum of their memoryMB."""

    max_sandboxes: int | None = None
    max_memory_mb: int | None = None


@dataclass
class CreateRequest:
    template_id: str = DEFAULT_TEMPLATE
    timeout: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    cpu_count: int | None = None
    memory_mb: int | None = None
    auto_pause: bool = False
    auto_pause_memory: bool = True
    auto_resume: bool = False
    egress: EgressPolicy = field(default_factory=EgressPolicy)
    # False: requests to the sandbox's own ports need its traffic access token.
    public_traffic: bool = True
    # The Host header its ports see, `${PORT}` replaced by the port (E2B's maskRequestHost).
    mask_request_host: str | None = None
    volume_mounts: list[MountRequest] = field(default_factory=list)
    # The name of the API key that asks (its quota applies); None: AENV_API_KEY or the node.
    owner: str | None = None
    # Seconds idle before standby (`orchestrator/idle.py`); None: the node's setting.
    standby_after: float | None = None
