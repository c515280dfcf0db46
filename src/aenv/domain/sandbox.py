"""A sandbox's record, and its JSON document as the catalog and a hibernation store it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from typing import Any

from ..egress import EgressPolicy
from .basics import (
    BootInfo,
    Instance,
    PausedState,
    PauseTier,
    PendingOp,
    SandboxState,
    VolumeMount,
)


@dataclass(frozen=True)
class Lineage:
    """Where a sandbox came from (docs/fork-tree.md): ids only, so a killed ancestor leaves
    nothing behind but its id in its descendants' records."""

    # The template it booted from; from a snapshot, the template the snapshot's sandbox was
    # created from; a fork child: its parent's.
    template_id: str | None = None
    # Created from this (user's) snapshot, taken of this sandbox.
    snapshot_id: str | None = None
    snapshot_of: str | None = None
    # Forked from this sandbox, at this snapshot (the fork's own: deleted once the children
    # run, so an id of the moment rather than something to create from).
    parent_id: str | None = None
    fork_point: str | None = None

    @property
    def origin(self) -> str | None:
        """The sandbox it came from, by fork or by snapshot; None from a template."""
        return self.parent_id or self.snapshot_of


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
    lineage: Lineage = field(default_factory=Lineage)
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
    # The layer stack (topmost first) of its last fork point — a fork child's, or the parent's
    # own last fork — which `diff`/`apply` compare against by default (docs/fork-tree.md).
    fork_layers: list[str] = field(default_factory=list)
    # The create's timeout in seconds, which an auto-resume gives it again (as E2B does);
    # None in records written before it was kept.
    timeout: int | None = None

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


def _lineage_of(d: dict[str, Any]) -> Lineage:
    """A record's lineage; one written before lineage had only the fork's `parent_id`."""
    doc = d.get("lineage")
    if isinstance(doc, dict):
        known = {f.name for f in fields(Lineage)}
        return Lineage(**{k: v for k, v in doc.items() if k in known})
    return Lineage(template_id=d.get("template_id"), parent_id=d.get("parent_id"))


def record_to_json(r: SandboxRecord) -> str:
    d = asdict(r)
    # Header transforms and their owner only when there are some: a record without them
    # reads the same on a node from before them (in a snapshot, in a shared repository).
    for key in ("rules", "owner"):
        if not d["egress"].get(key):
            d["egress"].pop(key, None)
    d["started_at"] = r.started_at.isoformat()
    d["end_at"] = r.end_at.isoformat()
    d["state"] = r.state.value
    if r.paused is not None:
        d["paused"] = {
            "tier": r.paused.tier.value,
            "paused_at": r.paused.paused_at.isoformat(),
            "image": r.paused.image,
            "published": r.paused.published,
            "standby": r.paused.standby,
        }
    return json.dumps(d)


def record_from_json(doc: str) -> SandboxRecord:
    d = json.loads(doc)
    d["started_at"] = datetime.fromisoformat(d["started_at"])
    d["end_at"] = datetime.fromisoformat(d["end_at"])
    d["state"] = SandboxState(d["state"])
    inst = d.get("instance")
    if inst is not None:
        if "container_id" in inst:  # written before the handle was opaque
            inst = {
                "sandbox_id": inst["sandbox_id"],
                "id": inst.pop("container_id"),
                "address": inst["address"],
                "data": inst,
            }
        d["instance"] = Instance(**inst)
    if d.get("paused") is None and d.get("paused_state"):  # the same, before PausedState
        d["paused"] = d["paused_state"]
    if d.get("paused") is not None:
        p = d["paused"]
        d["paused"] = PausedState(
            tier=PauseTier(p["tier"]),
            paused_at=datetime.fromisoformat(p["paused_at"]),
            image=p.get("image"),
            published=bool(p.get("published")),
            standby=bool(p.get("standby")),
        )
    if d.get("pending") is not None:
        d["pending"] = PendingOp(**d["pending"])
    d["boot"] = BootInfo(**(d.get("boot") or {}))
    if "egress" in d:
        d["egress"] = EgressPolicy(**d["egress"])
    elif "allow_internet_access" in d:  # before egress rules
        d["egress"] = EgressPolicy(allow_internet=bool(d["allow_internet_access"]))
    d["volume_mounts"] = [VolumeMount(**m) for m in d.get("volume_mounts") or []]
    d["lineage"] = _lineage_of(d)
    known = {f.name for f in fields(SandboxRecord)}
    return SandboxRecord(**{k: v for k, v in d.items() if k in known})
