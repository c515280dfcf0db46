"""E2B template builds (protocol §2.3): request, file uploads, start, status and logs.

`GET /templates`, `GET /templates/{id}`, `GET /templates/aliases/{alias}` and
`DELETE /templates/{id}` live in `snapshots.py` (templates and snapshots share the catalog)
and ask the builder (`get_builder`) about builds. This router must be included before that
one: its `/templates/{id:path}` would otherwise swallow the longer paths here.
"""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, Literal

from fastapi import APIRouter, Body, Depends, FastAPI, Query, Request, Response
from pydantic import Field

from aenv.builds.builder import Builder
from aenv.builds.store import BuildRecord, LogEntry
from aenv.errors import BadRequest

from ..auth import require_api_key
from ..models import ErrorBody
from ..wire import ApiRequest, ApiResponse

router = APIRouter(
    tags=["templates"],
    dependencies=[Depends(require_api_key)],
    responses={s: {"model": ErrorBody} for s in (400, 401, 404, 409, 500)},
)
# The upload URL handed to the SDK: authenticated by its signature, not the API key.
upload_router = APIRouter(
    tags=["templates"], responses={s: {"model": ErrorBody} for s in (400, 403, 500)}
)


def attach(app: FastAPI, builder: Builder) -> None:
    """The build routes over `builder` (started and closed by the node's lifespan)."""
    app.state.builder = builder
    app.include_router(router)
    app.include_router(upload_router)


def get_builder(request: Request) -> Builder:
    builder: Builder = request.app.state.builder
    return builder


BuilderDep = Annotated[Builder, Depends(get_builder)]


# --------------------------------------------------------------------------------------------
# models


class TemplateBuildRequest(ApiRequest):
    """`POST /v3/templates` (`name`), also the deprecated `alias`."""

    name: str | None = Field(default=None, min_length=1, max_length=128)
    alias: str | None = Field(default=None, min_length=1, max_length=128)
    tags: list[str] | None = None
    cpu_count: int | None = Field(default=None, alias="cpuCount", ge=1, le=16)
    memory_mb: int | None = Field(default=None, alias="memoryMB", ge=128, le=65536)
    min_free_disk_mb: int | None = Field(default=None, alias="minFreeDiskMb", ge=0)


class TemplateRequestResponse(ApiResponse):
    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID")
    public: bool = False
    names: list[str]
    tags: list[str]
    aliases: list[str]


class FileUpload(ApiResponse):
    present: bool
    url: str | None = None


class BuildLogEntry(ApiResponse):
    timestamp: datetime
    message: str
    level: Literal["debug", "info", "warn", "error"]
    step: str | None = None

    @classmethod
    def of(cls, e: LogEntry) -> BuildLogEntry:
        return cls(
            timestamp=datetime.fromtimestamp(e.ts, UTC),
            message=e.message,
            level=e.level,  # type: ignore[arg-type]
            step=e.step,
        )


class BuildStatusReason(ApiResponse):
    message: str
    step: str | None = None


class TemplateBuildInfo(ApiResponse):
    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID")
    status: Literal["building", "waiting", "ready", "error"]
    logs: list[str]
    log_entries: list[BuildLogEntry] = Field(alias="logEntries")
    reason: BuildStatusReason | None = None


class TemplateBuildLogs(ApiResponse):
    logs: list[BuildLogEntry]


class TemplateBuild(ApiResponse):
    """An item of `builds` in `GET /templates/{id}`."""

    _KEEP_NULL: ClassVar[frozenset[str]] = frozenset()

    build_id: str = Field(alias="buildID")
    status: str
    created_at: datetime = Field(alias="createdAt")
    updated_at: datetime = Field(alias="updatedAt")
    finished_at: datetime | None = Field(default=None, alias="finishedAt")
    cpu_count: int = Field(alias="cpuCount")
    memory_mb: int = Field(alias="memoryMB")

    @classmethod
    def of(cls, b: BuildRecord) -> TemplateBuild:
        return cls(
            buildID=b.build_id,
            status=b.status,
            createdAt=datetime.fromtimestamp(b.created, UTC),
            updatedAt=datetime.fromtimestamp(b.updated, UTC),
            finishedAt=datetime.fromtimestamp(b.finished, UTC) if b.finished else None,
            cpuCount=b.cpu_count,
            memoryMB=b.memory_mb,
        )


# --------------------------------------------------------------------------------------------
# routes


@router.post("/v3/templates", status_code=202, summary="Request a template build")
@router.post("/v2/templates", status_code=202, include_in_schema=False)
async def request_build(body: TemplateBuildRequest, builder: BuilderDep) -> TemplateRequestResponse:
    name = body.name or body.alias
    if not name:
        raise BadRequest("a template build needs a name")
    b = await builder.request(
        name, tags=body.tags, cpu_count=body.cpu_count, memory_mb=body.memory_mb
    )
    return TemplateRequestResponse(
        templateID=b.template_id,
        buildID=b.build_id,
        names=[b.name],
        tags=list(b.tags) or ["default"],
        aliases=[b.name],
    )


@router.get(
    "/templates/{template_id:path}/files/{files_hash}",
    status_code=201,
    summary="Where to upload a COPY step's files",
)
async def file_upload_link(
    template_id: str, files_hash: str, request: Request, builder: BuilderDep
) -> FileUpload:
    if builder.files.present(files_hash):
        return FileUpload(present=True)
    # Back at this server, on the host the client reached us by.
    url = request.url_for("upload_build_files", files_hash=files_hash)
    query = "&".join(f"{k}={v}" for k, v in builder.files.sign(files_hash).items())
    return FileUpload(present=False, url=f"{url}?{query}")


@upload_router.put(
    "/build-files/{files_hash}",
    status_code=201,
    name="upload_build_files",
    summary="Upload a COPY step's files (tar or tar.gz; the URL carries its signature)",
)
async def upload_build_files(
    files_hash: str,
    request: Request,
    builder: BuilderDep,
    expires: str | None = None,
    signature: str | None = None,
) -> Response:
    files = builder.files
    files.check(files_hash, expires, signature)
    files.path(files_hash)  # validates the hash
    staged = files.staging()
    try:
        fd = await asyncio.to_thread(os.open, staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > 8 << 30:
                    raise BadRequest("the uploaded files exceed 8 GiB")
                await asyncio.to_thread(os.write, fd, chunk)
        finally:
            await asyncio.to_thread(os.close, fd)
        await asyncio.to_thread(files.commit, staged, files_hash)
    except BaseException:
        await asyncio.to_thread(files.discard, staged)
        raise
    return Response(status_code=201)


@router.post(
    "/v2/templates/{template_id:path}/builds/{build_id}",
    status_code=202,
    response_class=Response,
    summary="Start a template build",
)
@router.post(
    "/templates/{template_id:path}/builds/{build_id}",
    status_code=202,
    response_class=Response,
    include_in_schema=False,
)
async def start_build(
    template_id: str,
    build_id: str,
    builder: BuilderDep,
    body: Annotated[dict[str, Any] | None, Body()] = None,
) -> Response:
    await builder.start_build(template_id, build_id, body or {})
    return Response(status_code=202)


@router.get("/templates/{template_id:path}/builds/{build_id}/status", summary="Build status")
async def build_status(
    template_id: str,
    build_id: str,
    builder: BuilderDep,
    logs_offset: int = Query(default=0, alias="logsOffset", ge=0),
    limit: int = Query(default=100, ge=1, le=100),
    level: Literal["debug", "info", "warn", "error"] | None = None,
) -> TemplateBuildInfo:
    b, entries = await asyncio.to_thread(
        builder.status, template_id, build_id, logs_offset, limit, level
    )
    reason = b.reason
    return TemplateBuildInfo(
        templateID=b.template_id,
        buildID=b.build_id,
        status=b.status,  # type: ignore[arg-type]
        logs=[e.message for e in entries],
        logEntries=[BuildLogEntry.of(e) for e in entries],
        reason=(
            BuildStatusReason(message=reason.message, step=reason.step)
            if reason and b.status == "error"
            else None
        ),
    )


@router.get("/templates/{template_id:path}/builds/{build_id}/logs", summary="Build logs")
async def build_logs(
    template_id: str,
    build_id: str,
    builder: BuilderDep,
    cursor: int | None = Query(default=None, ge=0, description="unix ms: entries from here"),
    limit: int = Query(default=100, ge=1, le=1000),
    direction: Literal["forward", "backward"] = "forward",
    level: Literal["debug", "info", "warn", "error"] | None = None,
) -> TemplateBuildLogs:
    _b, entries = await asyncio.to_thread(builder.status, template_id, build_id, 0, 1 << 30, level)
    if cursor is not None:
        entries = [e for e in entries if e.ts * 1000 >= cursor]
    if direction == "backward":
        entries = list(reversed(entries))
    return TemplateBuildLogs(logs=[BuildLogEntry.of(e) for e in entries[:limit]])
