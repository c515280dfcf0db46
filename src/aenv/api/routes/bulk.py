"""Bulk lifecycle by metadata (what RL harnesses' sweepers need): kill, pause, or set the
timeout of every live sandbox matching a metadata query, in one call.

`DELETE /sandboxes?metadata=k%3Dv` uses E2B's list-filter syntax; `POST /sandboxes/pause`
and `POST /sandboxes/timeout` take the same query. An empty or missing query is refused
(400): nobody kills every sandbox of a node by forgetting a parameter. Each answers the ids
it affected and, separately, those that failed (one sandbox's error does not stop the
rest; one that ended meanwhile is neither)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from aenv.domain import SandboxRecord
from aenv.errors import AenvError, BadRequest, NotFound
from aenv.orchestrator import Orchestrator, check_timeout

from ..auth import require_api_key
from ..deps import OrchestratorDep, SettingsDep
from ..listing import parse_metadata_filter
from ..models import LIFECYCLE_ERRORS, BulkFailure, BulkResult, TimeoutBody, api_state

router = APIRouter(
    tags=["sandboxes"], dependencies=[Depends(require_api_key)], responses=LIFECYCLE_ERRORS
)

MetadataQuery = Annotated[
    str | None, Query(description="urlencoded k=v&k2=v2 (required, non-empty)")
]

# Sandboxes acted on at once: a sweep of hundreds must not start hundreds of pauses (each
# a checkpoint to disk) together on a node of a few cores.
_PARALLEL = 8


def _matching(orchestrator: Orchestrator, raw: str | None, states: set[str]) -> list[str]:
    query = parse_metadata_filter(raw)
    if not query:
        raise BadRequest("a non-empty metadata query is required (metadata=k%3Dv)")
    records: list[SandboxRecord] = orchestrator.table.list(metadata=query, states=states)
    # The table's states are the API's: a sandbox being created or killed is not listed.
    return [r.sandbox_id for r in records if api_state(r) in states]


async def _each(ids: list[str], act: Callable[[str], Awaitable[object]]) -> BulkResult:
    gate = asyncio.Semaphore(_PARALLEL)
    done: list[str] = []
    failed: list[BulkFailure] = []

    async def one(sandbox_id: str) -> None:
        async with gate:
            try:
                await act(sandbox_id)
            except NotFound:
                return  # ended between the listing and the act: nothing to report
            except AenvError as e:
                failed.append(BulkFailure(sandboxID=sandbox_id, code=e.status, message=e.message))
                return
            done.append(sandbox_id)

    await asyncio.gather(*(one(i) for i in ids))
    order = {i: n for n, i in enumerate(ids)}  # the listing's order, not completion's
    done.sort(key=order.__getitem__)
    failed.sort(key=lambda f: order[f.sandbox_id])
    return BulkResult(sandboxIDs=done, failed=failed)


@router.delete("/sandboxes", summary="Kill every sandbox matching a metadata query")
async def kill_matching(
    orchestrator: OrchestratorDep, metadata: MetadataQuery = None
) -> BulkResult:
    ids = _matching(orchestrator, metadata, {"running", "paused"})
    return await _each(ids, orchestrator.sandboxes.kill)


@router.post("/sandboxes/pause", summary="Pause every running sandbox matching a metadata query")
async def pause_matching(
    orchestrator: OrchestratorDep, metadata: MetadataQuery = None
) -> BulkResult:
    ids = _matching(orchestrator, metadata, {"running"})
    return await _each(ids, orchestrator.pauser.pause)


@router.post(
    "/sandboxes/timeout",
    summary="Set the timeout of every running sandbox matching a metadata query",
)
async def timeout_matching(
    body: TimeoutBody,
    orchestrator: OrchestratorDep,
    settings: SettingsDep,
    metadata: MetadataQuery = None,
) -> BulkResult:
    check_timeout(body.timeout, settings)
    ids = _matching(orchestrator, metadata, {"running"})

    async def set_one(sandbox_id: str) -> object:
        return await orchestrator.sandboxes.set_timeout(sandbox_id, body.timeout)

    return await _each(ids, set_one)
