"""The bodies of the lifecycle events and webhooks routes: E2B's (their "Monitor sandbox
lifecycle events" and "Sandbox lifecycle webhooks" docs pages) and, for what E2B does not
serve, aenv's (a webhook's delivery history and stats)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from pydantic import Field

from aenv.errors import BadRequest
from aenv.orchestrator import TEAM_ID, Delivery, Webhook, WebhookStats

from .wire import ApiRequest, ApiResponse


class SandboxEvent(ApiResponse):
    """One lifecycle event (for the API reference: the routes answer the stored JSON)."""

    _KEEP_NULL: ClassVar[frozenset[str]] = frozenset({"eventData"})
    version: str
    id: str
    type: str
    event_data: dict[str, Any] | None = Field(alias="eventData")
    sandbox_build_id: str = Field(alias="sandboxBuildId")
    sandbox_execution_id: str = Field(alias="sandboxExecutionId")
    sandbox_id: str = Field(alias="sandboxId")
    sandbox_team_id: str = Field(alias="sandboxTeamId")
    sandbox_template_id: str = Field(alias="sandboxTemplateId")
    timestamp: datetime


class WebhookCreate(ApiRequest):
    name: str = Field(min_length=1, max_length=256)
    url: str = Field(min_length=1, max_length=2048)
    enabled: bool = True
    # Empty or left out: every type.
    events: list[str] = Field(default_factory=list, max_length=64)
    # Left out: the node makes one and answers it once, in this create's answer.
    signature_secret: str | None = Field(
        default=None, alias="signatureSecret", min_length=1, max_length=1024
    )


class WebhookUpdate(ApiRequest):
    name: str | None = Field(default=None, min_length=1, max_length=256)
    url: str | None = Field(default=None, min_length=1, max_length=2048)
    enabled: bool | None = None
    events: list[str] | None = Field(default=None, max_length=64)
    signature_secret: str | None = Field(
        default=None, alias="signatureSecret", min_length=1, max_length=1024
    )


class ClusterWebhook(ApiRequest):
    """A cluster's webhook as a gateway hands it to every node (its id and secret are the
    same on all of them)."""

    name: str = Field(min_length=1, max_length=256)
    url: str = Field(min_length=1, max_length=2048)
    enabled: bool = True
    events: list[str] = Field(default_factory=list, max_length=64)
    secret: str = Field(min_length=1, max_length=1024)
    # RFC 3339 (strict JSON has no datetime type).
    created_at: str = Field(alias="createdAt", max_length=64)

    def created(self) -> datetime:
        try:
            t = datetime.fromisoformat(self.created_at.replace("Z", "+00:00"))
        except ValueError:
            raise BadRequest(f"createdAt: not an RFC 3339 time: {self.created_at!r}") from None
        return t if t.tzinfo else t.replace(tzinfo=UTC)


class WebhookOut(ApiResponse):
    id: str
    team_id: str = Field(alias="teamId")
    name: str
    created_at: datetime = Field(alias="createdAt")
    enabled: bool
    url: str
    events: list[str]
    # Only in the answer of a create that made the secret itself.
    signature_secret: str | None = Field(default=None, alias="signatureSecret")

    @staticmethod
    def of(w: Webhook, *, secret: bool = False) -> WebhookOut:
        return WebhookOut(
            id=w.id,
            teamId=TEAM_ID,
            name=w.name,
            createdAt=w.created_at,
            enabled=w.enabled,
            url=w.url,
            events=w.events,
            signatureSecret=w.secret if secret else None,
        )


class WebhookDelivery(ApiResponse):
    """One attempt to deliver an event (or its drop: `outcome` `dropped`)."""

    id: str
    webhook_id: str = Field(alias="webhookId")
    event_id: str = Field(alias="eventId")
    event_type: str = Field(alias="eventType")
    sandbox_id: str = Field(alias="sandboxId")
    timestamp: datetime
    attempt: int
    outcome: str
    status_code: int | None = Field(default=None, alias="statusCode")
    duration_ms: int = Field(alias="durationMs")
    error: str | None = None

    @staticmethod
    def of(d: Delivery) -> WebhookDelivery:
        return WebhookDelivery(
            id=d.id,
            webhookId=d.webhook_id,
            eventId=d.event_id,
            eventType=d.event_type,
            sandboxId=d.sandbox_id,
            timestamp=d.at,
            attempt=d.attempt,
            outcome=d.outcome,
            statusCode=d.status_code,
            durationMs=d.duration_ms,
            error=d.error,
        )


class WebhookStatsOut(ApiResponse):
    delivered: int
    failed: int
    dropped: int
    backlog: int
    last_delivered_at: datetime | None = Field(default=None, alias="lastDeliveredAt")
    last_failed_at: datetime | None = Field(default=None, alias="lastFailedAt")
    last_error: str | None = Field(default=None, alias="lastError")

    @staticmethod
    def of(s: WebhookStats) -> WebhookStatsOut:
        return WebhookStatsOut(
            delivered=s.delivered,
            failed=s.failed,
            dropped=s.dropped,
            backlog=s.backlog,
            lastDeliveredAt=s.last_delivered_at,
            lastFailedAt=s.last_failed_at,
            lastError=s.last_error,
        )
