"""The node's typed records: what every layer passes (api, proxy, builds, orchestrator,
runtime). A leaf module: no I/O, no imports from the rest of aenv but its sibling leaf
`egress.py` (the egress policy record, re-exported here)."""

from __future__ import annotations

import contextlib
import enum
import re
import secrets
import string
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

# Re-exported: the egress policy is a record every layer passes too (its own module for size).
from .egress import DEFAULT_DNS_SERVER as DEFAULT_DNS_SERVER
from .egress import EgressPolicy as EgressPolicy
from .egress import domain_matches as domain_matches
from .egress import is_domain_entry as is_domain_entry

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


@dataclass
class SandboxRecord:
    sandbox_id: str
    template_id: str
    alias: str | None
    client_id: str
    started_at: datetime
    end_at: datetime
    cpu_count: int
    memory_mb: int
    disk_mb: int
    state: SandboxState
    envd_version: str
    envd_access_token: str
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    auto_pause: bool = False
    auto_pause_memory: bool = True
    auto_resume: bool = False
    egress: EgressPolicy = field(default_factory=EgressPolicy)
    # Non-empty for a private sandbox: what a request to one of its ports must carry in
    # `e2b-traffic-access-token` (envd's port has its own token).
    traffic_access_token: str = ""
    mask_request_host: str | None = None
    # The runtime's handle while a container exists (running, frozen); None otherwise.
    instance: Instance | None = None
    paused: PausedState | None = None
    # Why a sandbox was marked lost.
    note: str | None = None
    # The read-only layer stack under the sandbox (topmost first) and its writable upper dir:
    # snapshots seal the upper into a new layer on top of the stack.
    layers: list[str] = field(default_factory=list)
    upper: str | None = None
    boot: BootInfo = field(default_factory=BootInfo)
    # Where it came from when forked.
    parent_id: str | None = None
    # Layers a squash replaced that the running container may still have mounted: their
    # references are dropped once the sandbox boots on the new stack.
    retired_layers: list[str] = field(default_factory=list)
    # The operation in flight (crash recovery); None between operations.
    pending: PendingOp | None = None
    volume_mounts: list[VolumeMount] = field(default_factory=list)
    # The last live snapshot's copy of the upper (layers, topmost first, held by the
    # sandbox) and which upper it copied: the next live snapshot of that same upper takes
    # only what changed since.
    copied_as: list[str] = field(default_factory=list)
    copied_upper: str | None = None
    # The API key that created it (a fork child: its parent's), for per-key quotas.
    owner: str | None = None
    # Its own standby setting (None: the node's AENV_STANDBY_AFTER).
    standby_after: float | None = None

    @property
    def address(self) -> str | None:
        return None if self.instance is None else self.instance.address

    @property
    def tier(self) -> PauseTier | None:
        """The pause tier while paused, else None."""
        if self.state is not SandboxState.PAUSED or self.paused is None:
            return None
        return self.paused.tier

    @property
    def in_standby_on_disk(self) -> bool:
        """Hibernated by the node from standby: paused here, running to its user."""
        return self.state is SandboxState.PAUSED and self.paused is not None and self.paused.standby

    @property
    def shown_paused(self) -> bool:
        """Whether its user sees it paused (E2B's two states)."""
        return self.state is SandboxState.PAUSED and not self.in_standby_on_disk


class TemplateKind(enum.StrEnum):
    IMAGE = "image"  # an OCI image or the built-in base, booted cold
    TEMPLATE = "template"  # a finished template build
    SNAPSHOT = "snapshot"  # files + memory + processes of a sandbox
    HIBERNATION = "hibernation"  # a hibernated sandbox, in the repository only
    BUILD_STEP = "build-step"  # a build's transient stack


# Fields of a template document the core reads; every other key is its builder's (`extra`).
_TEMPLATE_FIELDS = (
    "kind",
    "layers",
    "internal",
    "checkpoint",
    "env",
    "user",
    "workdir",
    "cpu_count",
    "memory_mb",
    "created_at",
    "parent",
    "sandbox_id",
    "envd_token",
    "env_vars",
    "boot_of",
    "boot_from_layers",
    "boot_run",
    "published",
    "volume_mounts",
    "standby_after",
)


@dataclass
class TemplateRecord:
    """A template, snapshot or hibernation: a layer stack (topmost first), optionally a
    memory image, and what a sandbox booted from it inherits."""

    template_id: str
    kind: TemplateKind
    layers: list[str]
    names: list[str] = field(default_factory=list)
    # Not shown to users (build steps, boot snapshots, fork snapshots).
    internal: bool = False
    # The name of its memory image; None for a template booted cold.
    checkpoint: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    workdir: str | None = None
    cpu_count: int | None = None
    memory_mb: int | None = None
    created_at: str | None = None
    # The template a snapshot's sandbox was created from.
    parent: str | None = None
    # The sandbox a snapshot was taken of.
    sandbox_id: str | None = None
    # The access token the snapshotted envd holds (it authorises its re-initialisation).
    envd_token: str = ""
    env_vars: dict[str, str] = field(default_factory=dict)
    # A boot snapshot: of which template, over which of its layers, made by which node run.
    boot_of: str | None = None
    boot_from_layers: list[str] | None = None
    boot_run: str | None = None
    # In the durable repository.
    published: bool = False
    # What its builder keeps (build id, start command, source...): opaque to the core.
    extra: dict[str, Any] = field(default_factory=dict)
    # A snapshot's volumes (not their content): what sandboxes restored from it mount.
    volume_mounts: list[VolumeMount] = field(default_factory=list)
    # Seconds idle before standby for its sandboxes that set none (None: the node's).
    standby_after: float | None = None

    @property
    def has_memory(self) -> bool:
        return self.checkpoint is not None

    def boot_info(self) -> BootInfo:
        """What a sandbox booted from it inherits."""
        return BootInfo(
            env=dict(self.env), user=self.user, workdir=self.workdir, from_layers=list(self.layers)
        )

    def to_doc(self) -> dict[str, Any]:
        """The JSON document the catalog and the repository store (names kept apart)."""
        doc: dict[str, Any] = dict(self.extra)
        for name in _TEMPLATE_FIELDS:
            value = getattr(self, name)
            if name == "volume_mounts":
                value = [asdict(m) for m in value]
            doc[name] = value.value if isinstance(value, enum.Enum) else value
        return doc

    @classmethod
    def from_doc(
        cls, template_id: str, doc: dict[str, Any], names: list[str] | None = None
    ) -> TemplateRecord:
        rest = dict(doc)
        known = {k: rest.pop(k) for k in _TEMPLATE_FIELDS if k in rest}
        kind = known.pop("kind", None) or TemplateKind.TEMPLATE
        for key in ("env", "env_vars"):
            known[key] = dict(known.get(key) or {})
        for key in ("cpu_count", "memory_mb"):
            if known.get(key) is not None:
                known[key] = int(known[key])
        known["layers"] = list(known.get("layers") or [])
        known["internal"] = bool(known.get("internal"))
        known["published"] = bool(known.get("published"))
        known["envd_token"] = known.get("envd_token") or ""
        known["volume_mounts"] = [VolumeMount(**m) for m in known.get("volume_mounts") or []]
        if known.get("checkpoint") is not None:
            known["checkpoint"] = str(known["checkpoint"])
        return cls(
            template_id=template_id,
            kind=TemplateKind(kind),
            names=list(names or []),
            extra=rest,
            **known,
        )
