"""Observability routes: sandbox metrics and logs (E2B's shapes), the node (`/nodes`), and
the node's Prometheus exposition (`GET /metrics`).

All need the API key (`X-API-Key` or `Authorization: Bearer`, which is what a Prometheus
scrape config's `authorization` / `bearer_token` sends). `/metrics` here is the control
plane's; envd's own `/metrics` is refused on the data plane (proxy/dispatch.py), and a
request only reaches the data plane with a sandbox's `E2b-Sandbox-Id` or host name."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Response
from prometheus_client import CONTENT_TYPE_LATEST

from aenv.errors import BadRequest, NotFound
from aenv.orchestrator import LEVELS, LogEntry, Orchestrator

from ..auth import require_api_key
from ..deps import OrchestratorDep
from ..models import LIFECYCLE_ERRORS
from ..obs_models import (
    Node,
    NodeDetail,
    SandboxesWithMetrics,
    SandboxLog,
    SandboxLogEntry,
    SandboxLogs,
    SandboxLogsV2,
    SandboxMetric,
)

router = APIRouter(
    tags=["observability"], dependencies=[Depends(require_api_key)], responses=LIFECYCLE_ERRORS
)

# E2B's bound of `sandbox_ids` in one `GET /sandboxes/metrics`.
MAX_METRICS_IDS = 100
# Up to 9999-12-31, the last second a datetime holds.
Seconds = Annotated[int | None, Query(ge=0, le=253402300799)]
Millis = Annotated[int | None, Query(ge=0, le=2**50)]


def _at(seconds: int | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def _ms(e: LogEntry) -> int:
    return int(e.at.timestamp() * 1000)


def _visible(orchestrator: Orchestrator, sandbox_id: str) -> None:
    # Raises NotFound for a sandbox its user cannot see.
    orchestrator.table.get(sandbox_id)


# ----------------------------------------------------------------------------- metrics
# Before `/sandboxes/{sandbox_id}` (sandboxes.py) would take `metrics` for an id.


@router.get("/sandboxes/metrics", summary="The latest metrics of several sandboxes")
async def sandboxes_metrics(
    orchestrator: OrchestratorDep,
    # A bound on the length here would be in the document, and fuzzers' longer negatives
    # past what the HTTP parser takes in a request line: the bound is checked below.
    sandbox_ids: Annotated[str, Query(description="comma-separated sandbox ids (at most 100)")],
) -> SandboxesWithMetrics:
    ids = [s for s in dict.fromkeys(x.strip() for x in sandbox_ids.split(",")) if s]
    if len(ids) > MAX_METRICS_IDS:
        raise BadRequest(f"at most {MAX_METRICS_IDS} sandbox ids at once")
    out: dict[str, SandboxMetric] = {}
    for sid in ids:
        sample = orchestrator.metrics.latest(sid)
        if sample is not None:
            out[sid] = SandboxMetric.of(sample)
    return SandboxesWithMetrics(sandboxes=out)


@router.get("/sandboxes/{sandbox_id}/metrics", summary="A sandbox's metrics over time")
async def sandbox_metrics(
    sandbox_id: str,
    orchestrator: OrchestratorDep,
    start: Seconds = None,
    end: Seconds = None,
) -> list[SandboxMetric]:
    if start is not None and end is not None and start > end:
        raise BadRequest("start must not be after end")
    samples = orchestrator.metrics.series(sandbox_id, _at(start), _at(end))
    return [SandboxMetric.of(s) for s in samples]


# ----------------------------------------------------------------------------- logs


@router.get("/sandboxes/{sandbox_id}/logs", summary="A sandbox's logs (v1)")
async def sandbox_logs_v1(
    sandbox_id: str,
    orchestrator: OrchestratorDep,
    start: Millis = None,
    limit: Annotated[int, Query(ge=0, le=2**31 - 1)] = 1000,
) -> SandboxLogs:
    entries = [
        e for e in await orchestrator.logs.read(sandbox_id) if start is None or _ms(e) >= start
    ]
    entries = entries[:limit]
    return SandboxLogs(
        logs=[SandboxLog(timestamp=e.at, line=e.line) for e in entries],
        logEntries=[SandboxLogEntry.of(e) for e in entries],
    )


@router.get("/v2/sandboxes/{sandbox_id}/logs", summary="A sandbox's logs")
async def sandbox_logs_v2(
    sandbox_id: str,
    orchestrator: OrchestratorDep,
    cursor: Millis = None,
    limit: Annotated[int, Query(ge=0, le=1000)] = 1000,
    direction: Literal["forward", "backward"] = "forward",
    level: Literal["debug", "info", "warn", "error"] | None = None,
    search: Annotated[str | None, Query(max_length=256)] = None,
) -> SandboxLogsV2:
    entries = await orchestrator.logs.read(sandbox_id)
    if level is not None:
        floor = LEVELS.index(level)
        entries = [e for e in entries if LEVELS.index(e.level) >= floor]
    if search:
        entries = [e for e in entries if search in e.message]
    if direction == "forward":
        if cursor is not None:
            entries = [e for e in entries if _ms(e) >= cursor]
    else:
        if cursor is not None:
            entries = [e for e in entries if _ms(e) <= cursor]
        entries.reverse()
    return SandboxLogsV2(logs=[SandboxLogEntry.of(e) for e in entries[:limit]])


# ----------------------------------------------------------------------------- the node


@router.get("/nodes", summary="The nodes (this one)")
async def nodes(
    orchestrator: OrchestratorDep,
    cluster_id: Annotated[str | None, Query(alias="clusterID")] = None,
) -> list[Node]:
    return [Node.of(await orchestrator.stats.info())]


@router.get("/nodes/{node_id}", summary="A node and its sandboxes")
async def node(
    node_id: str,
    orchestrator: OrchestratorDep,
    cluster_id: Annotated[str | None, Query(alias="clusterID")] = None,
) -> NodeDetail:
    info = await orchestrator.stats.info(with_sandboxes=True)
    if node_id not in (info.node_id, info.service_instance_id):
        raise NotFound(f"node {node_id!r} not found")
    return NodeDetail.of(info)


@router.get(
    "/metrics",
    summary="Prometheus metrics of the node",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
)
async def prometheus(orchestrator: OrchestratorDep) -> Response:
    return Response(await orchestrator.stats.exposition(), media_type=CONTENT_TYPE_LATEST)
