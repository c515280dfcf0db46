"""Lifecycle events and webhooks, E2B's routes (`GET /events/sandboxes`,
`GET /events/sandboxes/{sandboxID}`, `/events/webhooks` and `/events/webhooks/{webhookID}`)
and aenv's for what E2B does not serve: a webhook's delivery history and stats. The work is
the orchestrator's `Events` part (orchestrator/events.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Query, Response

from aenv.errors import BadRequest
from aenv.orchestrator import EVENT_TYPES, MAX_EVENTS_LIMIT, LifecycleEvent, Webhook

from ..auth import require_api_key
from ..deps import OrchestratorDep
from ..event_models import (
    ClusterWebhook,
    SandboxEvent,
    WebhookCreate,
    WebhookDelivery,
    WebhookOut,
    WebhookStatsOut,
    WebhookUpdate,
)
from ..models import ErrorBody

router = APIRouter(
    tags=["events"],
    dependencies=[Depends(require_api_key)],
    responses={s: {"model": ErrorBody} for s in (400, 401, 404, 500)},
)

# E2B's paging of events: `offset` from 0, `limit` 1..100 (10 by default), newest first
# unless `orderAsc`, `types` repeated for any of several. Out of range is a 400 (the error
# handlers turn validation errors into E2B's 400 body).
Offset = Annotated[int, Query(ge=0, le=2**31)]
Limit = Annotated[int, Query(ge=1, le=MAX_EVENTS_LIMIT)]
OrderAsc = Annotated[bool, Query(alias="orderAsc")]
Types = Annotated[list[str] | None, Query(max_length=64)]
_EVENTS: dict[int | str, dict[str, Any]] = {200: {"model": list[SandboxEvent]}}


def _types(types: list[str] | None) -> list[str]:
    # Repeated (`types=a&types=b`, as E2B's spec has it) or comma-separated.
    return [t.strip() for v in types or () for t in v.split(",") if t.strip()]


def _array(bodies: list[str]) -> Response:
    # The stored JSON as it is: the same bytes a webhook received.
    return Response("[" + ",".join(bodies) + "]", media_type="application/json")


@router.get(
    "/events/sandboxes",
    summary="Lifecycle events of every sandbox",
    response_class=Response,
    responses=_EVENTS,
)
async def list_events(
    orchestrator: OrchestratorDep,
    offset: Offset = 0,
    limit: Limit = 10,
    order_asc: OrderAsc = False,
    types: Types = None,
) -> Response:
    bodies = await orchestrator.events.query(
        types=_types(types), offset=offset, limit=limit, ascending=order_asc
    )
    return _array(bodies)


@router.get(
    "/events/sandboxes/{sandbox_id}",
    summary="Lifecycle events of one sandbox",
    response_class=Response,
    responses=_EVENTS,
)
async def sandbox_events(
    sandbox_id: str,
    orchestrator: OrchestratorDep,
    offset: Offset = 0,
    limit: Limit = 10,
    order_asc: OrderAsc = False,
    types: Types = None,
) -> Response:
    # A killed sandbox's events are kept: an unknown id is an empty list, not a 404.
    bodies = await orchestrator.events.query(
        sandbox_id=sandbox_id,
        types=_types(types),
        offset=offset,
        limit=limit,
        ascending=order_asc,
    )
    return _array(bodies)


@router.post("/events/webhooks", status_code=201, summary="Register a webhook")
async def create_webhook(body: WebhookCreate, orchestrator: OrchestratorDep) -> WebhookOut:
    w = await orchestrator.events.create_webhook(
        name=body.name,
        url=body.url,
        events=body.events,
        secret=body.signature_secret,
        enabled=body.enabled,
    )
    return WebhookOut.of(w, secret=body.signature_secret is None)


@router.get("/events/webhooks", summary="The webhooks")
async def list_webhooks(orchestrator: OrchestratorDep) -> list[WebhookOut]:
    return [WebhookOut.of(w) for w in await orchestrator.events.webhooks()]


@router.get("/events/webhooks/{webhook_id}", summary="A webhook")
async def get_webhook(webhook_id: str, orchestrator: OrchestratorDep) -> WebhookOut:
    return WebhookOut.of(await orchestrator.events.webhook(webhook_id))


@router.patch("/events/webhooks/{webhook_id}", summary="Change a webhook")
async def update_webhook(
    webhook_id: str, body: WebhookUpdate, orchestrator: OrchestratorDep
) -> WebhookOut:
    w = await orchestrator.events.update_webhook(
        webhook_id,
        name=body.name,
        url=body.url,
        events=body.events,
        enabled=body.enabled,
        secret=body.signature_secret,
    )
    return WebhookOut.of(w)


@router.delete("/events/webhooks/{webhook_id}", summary="Delete a webhook")
async def delete_webhook(webhook_id: str, orchestrator: OrchestratorDep) -> Response:
    await orchestrator.events.delete_webhook(webhook_id)
    return Response(status_code=200)


@router.get(
    "/events/webhooks/{webhook_id}/deliveries",
    summary="A webhook's delivery attempts, newest first (aenv)",
)
async def webhook_deliveries(
    webhook_id: str,
    orchestrator: OrchestratorDep,
    offset: Offset = 0,
    limit: Limit = 10,
) -> list[WebhookDelivery]:
    found = await orchestrator.events.deliveries(webhook_id, offset, limit)
    return [WebhookDelivery.of(d) for d in found]


@router.get("/events/webhooks/{webhook_id}/stats", summary="A webhook's delivery stats (aenv)")
async def webhook_stats(webhook_id: str, orchestrator: OrchestratorDep) -> WebhookStatsOut:
    return WebhookStatsOut.of(await orchestrator.events.stats(webhook_id))


# ----------------------------------------------------------------------------- cluster
# What gateways ask a node: keep a cluster's webhook under its id and secret, and record an
# event only a gateway saw (a sandbox lost with its node), which this node then delivers.


@router.put("/cluster/webhooks/{webhook_id}", summary="Keep a cluster's webhook (gateways)")
async def put_cluster_webhook(
    webhook_id: str, body: ClusterWebhook, orchestrator: OrchestratorDep
) -> WebhookOut:
    w = await orchestrator.events.put_webhook(
        Webhook(
            id=webhook_id,
            name=body.name,
            url=body.url,
            events=body.events,
            secret=body.secret,
            enabled=body.enabled,
            created_at=body.created(),
        )
    )
    return WebhookOut.of(w)


@router.post("/cluster/events", status_code=202, summary="Record an event a gateway saw")
async def record_cluster_event(
    orchestrator: OrchestratorDep, body: Annotated[dict[str, Any], Body()]
) -> Response:
    try:
        event = LifecycleEvent.from_wire(body)
    except (KeyError, ValueError, TypeError) as e:
        raise BadRequest(f"not a lifecycle event: {e}") from e
    if event.type not in EVENT_TYPES:
        raise BadRequest(f"unknown event type {event.type!r}")
    orchestrator.events.append(event)
    return Response(status_code=202)
