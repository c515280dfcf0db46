"""Volumes (E2B's `/volumes`, with an API key) and their files (`/volumecontent/{id}/…`,
with the volume's own token as `Authorization: Bearer`, the route the SDK's `Volume`
reaches at `E2B_VOLUME_API_URL`, or `api.{domain}`: this same listener)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Annotated, Any, BinaryIO

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from aenv.errors import Unauthorized
from aenv.volumes import VolumeFiles, VolumeRecord

from ..auth import require_api_key
from ..deps import OrchestratorDep, get_orchestrator
from ..models import ErrorBody
from ..wire import ApiRequest, ApiResponse

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody} for status in (400, 401, 404, 409, 500)
}
router = APIRouter(tags=["volumes"], dependencies=[Depends(require_api_key)], responses=_ERRORS)
content_router = APIRouter(
    tags=["volume content"], responses={**_ERRORS, 507: {"model": ErrorBody}}
)

CHUNK = 1 << 20
UINT32 = (1 << 32) - 1


class NewVolume(ApiRequest):
    name: str = Field(min_length=1, max_length=255)


class VolumeInfo(ApiResponse):
    volume_id: str = Field(alias="volumeID")
    name: str

    @classmethod
    def of(cls, v: VolumeRecord) -> VolumeInfo:
        return cls(volumeID=v.volume_id, name=v.name)


class VolumeAndToken(VolumeInfo):
    token: str

    @classmethod
    def of(cls, v: VolumeRecord) -> VolumeAndToken:
        return cls(volumeID=v.volume_id, name=v.name, token=v.token)


class MetadataPatch(ApiRequest):
    uid: int | None = Field(default=None, ge=0, le=UINT32)
    gid: int | None = Field(default=None, ge=0, le=UINT32)
    mode: int | None = Field(default=None, ge=0, le=UINT32)


# --------------------------------------------------------------------------------------------
# /volumes


@router.post("/volumes", status_code=201, summary="Create a volume")
async def create_volume(body: NewVolume, orchestrator: OrchestratorDep) -> VolumeAndToken:
    return VolumeAndToken.of(await orchestrator.volumes.create(body.name))


@router.get("/volumes", summary="List volumes")
async def list_volumes(orchestrator: OrchestratorDep) -> list[VolumeInfo]:
    return [VolumeInfo.of(v) for v in await orchestrator.volumes.all()]


@router.get("/volumes/{volume_id}", summary="Get a volume and its token")
async def get_volume(volume_id: str, orchestrator: OrchestratorDep) -> VolumeAndToken:
    return VolumeAndToken.of(await orchestrator.volumes.get(volume_id))


@router.delete("/volumes/{volume_id}", status_code=204, summary="Delete a volume")
async def delete_volume(volume_id: str, orchestrator: OrchestratorDep) -> Response:
    await orchestrator.volumes.delete(volume_id)
    return Response(status_code=204)


# --------------------------------------------------------------------------------------------
# /volumecontent


async def volume_files(volume_id: str, request: Request) -> VolumeFiles:
    """The files of the volume the request's bearer token opens."""
    tokens = []
    for auth in request.headers.getlist("authorization"):
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() == "bearer":
            tokens.append(token.strip())
    if len(tokens) != 1:
        raise Unauthorized("send the volume's token once, as Authorization: Bearer TOKEN")
    return await get_orchestrator(request).volumes.files(volume_id, tokens[0])


Files = Annotated[VolumeFiles, Depends(volume_files)]
PathQuery = Annotated[str, Query(min_length=1, max_length=4096)]
Id = Annotated[int | None, Query(ge=0, le=UINT32)]


def _stat_json(entry: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(entry.to_json(), status_code=status)


@content_router.get("/volumecontent/{volume_id}/path", summary="Stat a path")
async def stat_path(files: Files, path: PathQuery) -> JSONResponse:
    return _stat_json(await asyncio.to_thread(files.stat, path))


@content_router.patch("/volumecontent/{volume_id}/path", summary="Change owner or mode")
async def patch_path(files: Files, path: PathQuery, body: MetadataPatch) -> JSONResponse:
    entry = await asyncio.to_thread(files.update, path, uid=body.uid, gid=body.gid, mode=body.mode)
    return _stat_json(entry)


@content_router.delete("/volumecontent/{volume_id}/path", status_code=204, summary="Remove a path")
async def delete_path(files: Files, path: PathQuery) -> Response:
    await asyncio.to_thread(files.remove, path)
    return Response(status_code=204)


@content_router.get("/volumecontent/{volume_id}/dir", summary="List a directory")
async def list_dir(
    files: Files, path: PathQuery, depth: Annotated[int, Query(ge=0, le=UINT32)] = 1
) -> JSONResponse:
    entries = await asyncio.to_thread(files.list_dir, path, depth)
    return JSONResponse([e.to_json() for e in entries])


@content_router.post("/volumecontent/{volume_id}/dir", summary="Make a directory")
async def make_dir(
    files: Files,
    path: PathQuery,
    uid: Id = None,
    gid: Id = None,
    mode: Id = None,
    force: bool | None = None,
) -> JSONResponse:
    entry = await asyncio.to_thread(
        files.make_dir, path, uid=uid, gid=gid, mode=mode, force=bool(force)
    )
    return _stat_json(entry, 201)


@content_router.get(
    "/volumecontent/{volume_id}/file",
    summary="Download a file",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
async def read_file(files: Files, path: PathQuery) -> StreamingResponse:
    f, size = await asyncio.to_thread(files.open_file, path)
    return StreamingResponse(
        _chunks(f, size),  # a plain iterator: Starlette reads it in its thread pool
        media_type="application/octet-stream",
        headers={"content-length": str(size)},
    )


def _chunks(f: BinaryIO, size: int) -> Iterator[bytes]:
    """The file's first `size` bytes: what it held when opened (a sandbox may be appending
    to it, and the answer promised that length)."""
    left = size
    with f:
        while left > 0 and (chunk := f.read(min(CHUNK, left))):
            left -= len(chunk)
            yield chunk


@content_router.put("/volumecontent/{volume_id}/file", summary="Upload a file")
async def write_file(
    request: Request,
    files: Files,
    path: PathQuery,
    uid: Id = None,
    gid: Id = None,
    mode: Id = None,
    force: bool | None = None,
) -> JSONResponse:
    """Streams the body into place; an existing file is replaced unless `force=false`."""
    writer = files.writer(path, uid=uid, gid=gid, mode=mode, overwrite=force is not False)
    upload = await asyncio.to_thread(writer.__enter__)
    try:
        async for chunk in request.stream():
            if chunk:
                await asyncio.to_thread(upload.write, chunk)
        entry = await asyncio.to_thread(upload.commit)
    except BaseException:
        await asyncio.to_thread(writer.__exit__, *sys.exc_info())
        raise
    await asyncio.to_thread(writer.__exit__, None, None, None)
    return _stat_json(entry, 201)
