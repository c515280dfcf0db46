"""The orchestrator's records, as the API and the catalog see them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any


class State(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    KILLING = "killing"
    KILLED = "killed"
    # The server restarted and could not recover a sandbox that was running.
    LOST = "lost"


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass
class CreateRequest:
    template_id: str = "base"
    timeout: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    cpu_count: int | None = None
    memory_mb: int | None = None
    auto_pause: bool = False
    auto_pause_memory: bool = True
    auto_resume: bool = False
    secure: bool = True
    allow_internet_access: bool = True


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
    state: State
    envd_version: str
    envd_access_token: str
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    auto_pause: bool = False
    auto_pause_memory: bool = True
    auto_resume: bool = False
    allow_internet_access: bool = True
    # Backend instance (runtime.base.Instance.to_json()); None when not running.
    instance: dict[str, Any] | None = None
    # Where a paused sandbox's state lives (checkpoint dir etc.), filled by the pause issue.
    paused_state: dict[str, Any] | None = None
    # Free-form, e.g. why a sandbox was marked lost.
    note: str | None = None
    # The read-only layer stack under the sandbox (topmost first) and its writable upper dir:
    # snapshots seal the upper into a new layer on top of the stack.
    layers: list[str] = field(default_factory=list)
    upper: str | None = None
    # Template document fields the sandbox inherited (env, user, workdir) for re-boots.
    boot: dict[str, Any] = field(default_factory=dict)
    # Where it came from when forked.
    parent_id: str | None = None
    # Layers a squash replaced that the running container may still have mounted: their
    # references are dropped once the sandbox boots on the new stack.
    retired_layers: list[str] = field(default_factory=list)

    @property
    def address(self) -> str | None:
        return None if self.instance is None else str(self.instance["address"])
