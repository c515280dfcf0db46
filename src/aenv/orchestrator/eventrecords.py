"""The typed records of lifecycle events and webhooks (no I/O): what the node records about a
sandbox's life, the webhooks it delivers those events to, and each delivery attempt.

An event's wire form is E2B's (their docs' "Monitor sandbox lifecycle events" and "Sandbox
lifecycle webhooks" pages; the field set of `packages/shared/pkg/events/sandbox.go` in
e2b-dev/infra): `version`, `id`, `type`, `eventData`, `sandboxBuildId`, `sandboxExecutionId`,
`sandboxId`, `sandboxTeamId`, `sandboxTemplateId`, `timestamp`. The same bytes are the
API's answer and a webhook's body (the signature covers them)."""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

# E2B's types (e2b-dev/infra `events/sandbox.go`: `ValidSandboxEventTypes`).
CREATED: Final = "sandbox.lifecycle.created"
KILLED: Final = "sandbox.lifecycle.killed"
PAUSED: Final = "sandbox.lifecycle.paused"
RESUMED: Final = "sandbox.lifecycle.resumed"
UPDATED: Final = "sandbox.lifecycle.updated"
# E2B's name for a snapshot of a sandbox that goes on running (`createSnapshot`).
CHECKPOINTED: Final = "sandbox.lifecycle.checkpointed"
# aenv's own, where E2B has none.
FORKED: Final = "sandbox.lifecycle.forked"
MOVED: Final = "sandbox.lifecycle.moved"
OOM: Final = "sandbox.lifecycle.oom"
ROLLED_BACK: Final = "sandbox.lifecycle.rolled_back"

E2B_TYPES: Final = (CREATED, KILLED, PAUSED, RESUMED, UPDATED, CHECKPOINTED)
EVENT_TYPES: Final = (*E2B_TYPES, FORKED, MOVED, OOM, ROLLED_BACK)

# `eventData.kill_reason` of a killed event: E2B's (`request`, `timeout`; e2b-dev/infra
# `sandboxtypes/states.go`) and aenv's: the host killed it at its memory limit, its runtime
# died otherwise, it did not survive a node restart, its node left the cluster, a template
# build's step ended with it; `unknown` (E2B's too): a kill a crash cut short.
KILL_REQUEST: Final = "request"
KILL_TIMEOUT: Final = "timeout"
KILL_OOM: Final = "oom"
KILL_DIED: Final = "died"
KILL_LOST: Final = "lost"
KILL_NODE_LOST: Final = "node_lost"
KILL_BUILD: Final = "build"
KILL_UNKNOWN: Final = "unknown"

# Written by E2B's orchestrator today (`StructureVersionV2`: the dot-named `type`); their
# docs' older examples show "v1".
VERSION: Final = "v2"
# The team every sandbox of an aenv node belongs to (aenv has API keys, not teams): the
# same zero UUID the API gives as `clusterID`.
TEAM_ID: Final = "00000000-0000-0000-0000-000000000000"
_EXECUTION_NS: Final = uuid.UUID("6f1d3c1e-8a35-4f0e-9d7c-0b7a4b3c2e11")


def iso(t: datetime) -> str:
    """RFC 3339 in UTC with a `Z`, as E2B writes times."""
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def execution_id(sandbox_id: str, started_at: datetime) -> str:
    """E2B's `sandboxExecutionId`: one per run of a sandbox (stable for its record)."""
    return str(uuid.uuid5(_EXECUTION_NS, f"{sandbox_id}/{started_at.isoformat()}"))


@dataclass(frozen=True)
class LifecycleEvent:
    id: str
    type: str
    timestamp: datetime
    sandbox_id: str
    template_id: str = ""
    execution_id: str = ""
    build_id: str = ""
    data: dict[str, Any] | None = None

    def wire(self) -> dict[str, Any]:
        """E2B's JSON shape."""
        return {
            "version": VERSION,
            "id": self.id,
            "type": self.type,
            "eventData": self.data,
            "sandboxBuildId": self.build_id,
            "sandboxExecutionId": self.execution_id,
            "sandboxId": self.sandbox_id,
            "sandboxTeamId": TEAM_ID,
            "sandboxTemplateId": self.template_id,
            "timestamp": iso(self.timestamp),
        }

    def body(self) -> bytes:
        """The bytes the API stores and a webhook receives (and its signature covers)."""
        return json.dumps(self.wire(), separators=(",", ":")).encode()

    @staticmethod
    def from_wire(d: dict[str, Any]) -> LifecycleEvent:
        return LifecycleEvent(
            id=str(d["id"]),
            type=str(d["type"]),
            timestamp=datetime.fromisoformat(str(d["timestamp"]).replace("Z", "+00:00")),
            sandbox_id=str(d["sandboxId"]),
            template_id=str(d.get("sandboxTemplateId") or ""),
            execution_id=str(d.get("sandboxExecutionId") or ""),
            build_id=str(d.get("sandboxBuildId") or ""),
            data=d.get("eventData"),
        )


def signature(secret: str, body: bytes) -> str:
    """E2B's `e2b-signature`: SHA-256 of the secret followed by the raw body, base64url
    without padding (the verification code of their "Sandbox lifecycle webhooks" page,
    e2b-dev/docs `docs/sandbox/lifecycle-events-webhooks.mdx`). Not an HMAC."""
    digest = hashlib.sha256(secret.encode() + body).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


@dataclass
class Webhook:
    id: str
    name: str
    url: str
    events: list[str]
    secret: str
    enabled: bool = True
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    def wants(self, event_type: str) -> bool:
        return self.enabled and (not self.events or event_type in self.events)

    def to_doc(self) -> str:
        return json.dumps(
            {
                "id": self.id,
                "name": self.name,
                "url": self.url,
                "events": self.events,
                "secret": self.secret,
                "enabled": self.enabled,
                "createdAt": iso(self.created_at),
            }
        )

    @staticmethod
    def from_doc(doc: str) -> Webhook:
        d = json.loads(doc)
        return Webhook(
            id=d["id"],
            name=d["name"],
            url=d["url"],
            events=list(d["events"]),
            secret=d["secret"],
            enabled=bool(d["enabled"]),
            created_at=datetime.fromisoformat(d["createdAt"].replace("Z", "+00:00")),
        )


# A delivery attempt's outcome (also the `outcome` label of `aenv_webhook_deliveries`):
# the receiver answered 2xx; it did not (retried later); the event was dropped undelivered
# (the backlog bound, or past the retention).
DELIVERED: Final = "delivered"
FAILED: Final = "failed"
DROPPED: Final = "dropped"
OUTCOMES: Final = (DELIVERED, FAILED, DROPPED)


@dataclass(frozen=True)
class Delivery:
    """One attempt (or one drop) of one event to one webhook."""

    id: str
    webhook_id: str
    event_id: str
    event_type: str
    sandbox_id: str
    at: datetime
    attempt: int
    outcome: str
    status_code: int | None = None
    duration_ms: int = 0
    error: str | None = None


@dataclass(frozen=True)
class WebhookStats:
    delivered: int
    failed: int
    dropped: int
    backlog: int
    last_delivered_at: datetime | None
    last_failed_at: datetime | None
    last_error: str | None


@dataclass(frozen=True)
class Due:
    """An event waiting for a webhook, as its deliverer takes it."""

    seq: int
    sandbox_id: str
    attempts: int
    event: LifecycleEvent
    body: bytes
