"""The fork tree's routes (aenv's, docs/fork-tree.md): `GET /sandboxes/{id}/diff`, what a
sandbox changed since a base — its fork point by default, a snapshot, another sandbox — as a
list, a unified diff or a tar; `POST /sandboxes/{id}/apply`, another sandbox's changes taken
into it; `POST /sandboxes/{id}/rollback`, back to one of its own snapshots in place."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import IO, Annotated, Literal

from fastapi import APIRouter, Depends, Query, Response
from fastapi.responses import StreamingResponse

from aenv.domain import Timings
from aenv.images.treediff import DEFAULT_EXCLUDE, Change, tar_file, unified

from ..auth import require_api_key
from ..deps import OrchestratorDep
from ..models import LIFECYCLE_ERRORS
from ..tree_models import (
    ApplyRequest,
    ApplyResult,
    ChangeInfo,
    RollbackRequest,
    RollbackResult,
)
from .sandboxes import SERVER_TIMING_HEADER, add_timing

router = APIRouter(
    tags=["sandboxes"], dependencies=[Depends(require_api_key)], responses=LIFECYCLE_ERRORS
)

_CHUNK = 1 << 16


def _excludes(exclude: list[str], defaults: bool) -> list[str]:
    return [*(DEFAULT_EXCLUDE if defaults else ()), *exclude]


@router.get(
    "/sandboxes/{sandbox_id}/diff",
    summary="What a sandbox changed since a base",
    response_model=list[ChangeInfo],
)
async def get_diff(
    sandbox_id: str,
    response: Response,
    orchestrator: OrchestratorDep,
    base: Annotated[
        str | None, Query(description="fork-point (default), a snapshot or sandbox id")
    ] = None,
    exclude: Annotated[list[str], Query()] = [],  # noqa: B006 (FastAPI copies it)
    default_excludes: Annotated[bool, Query(alias="defaultExcludes")] = True,
    format: Annotated[Literal["json", "patch", "tar"], Query()] = "json",
) -> object:
    timings = Timings()
    changes = await orchestrator.diffs.diff(
        sandbox_id, base, _excludes(exclude, default_excludes), timings
    )
    headers = {SERVER_TIMING_HEADER: timings.header()} if timings.header() else {}
    if format == "patch":
        return StreamingResponse(
            _patch(changes), media_type="text/x-diff; charset=utf-8", headers=headers
        )
    if format == "tar":
        tar = await asyncio.to_thread(tar_file, changes)
        return StreamingResponse(
            _stream(tar),
            media_type="application/x-tar",
            headers={
                **headers,
                "Content-Disposition": f'attachment; filename="{sandbox_id}.tar"',
            },
        )
    response.headers.update(headers)
    return [ChangeInfo.of(c) for c in changes]


@router.post(
    "/sandboxes/{sandbox_id}/apply", summary="Take another sandbox's changes into this one"
)
async def post_apply(
    sandbox_id: str, body: ApplyRequest, response: Response, orchestrator: OrchestratorDep
) -> ApplyResult:
    timings = Timings()
    done = await orchestrator.diffs.apply(
        sandbox_id,
        body.source,
        body.base,
        body.paths,
        _excludes(body.exclude, body.default_excludes),
        body.strategy,
        timings,
    )
    add_timing(response, timings)
    return ApplyResult(applied=[ChangeInfo.of(c) for c in done.changes], conflicts=done.conflicts)


@router.post(
    "/sandboxes/{sandbox_id}/rollback", summary="Bring a sandbox back to one of its snapshots"
)
async def post_rollback(
    sandbox_id: str, body: RollbackRequest, response: Response, orchestrator: OrchestratorDep
) -> RollbackResult:
    timings = Timings()
    await orchestrator.rollbacks.rollback(sandbox_id, body.snapshot_id, timings)
    add_timing(response, timings)
    return RollbackResult(sandboxID=sandbox_id, snapshotID=body.snapshot_id)


def _patch(changes: list[Change]) -> Iterator[bytes]:
    # A sync iterator: Starlette runs it in a thread pool, off the event loop.
    for text in unified(changes):
        yield text.encode()


async def _stream(f: IO[bytes]) -> AsyncIterator[bytes]:
    try:
        while chunk := await asyncio.to_thread(f.read, _CHUNK):
            yield chunk
    finally:
        f.close()
