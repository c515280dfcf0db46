"""Snapshots, fork and the template catalog (snapshots are templates)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import Field

from aenv import ENVD_VERSION
from aenv.builds.store import BuildRecord
from aenv.builds.tags import build_id_of, main_name, owner_of
from aenv.domain import TemplateKind, TemplateRecord, Timings
from aenv.errors import NotFound
from aenv.orchestrator import Orchestrator

from ..auth import key_name, require_api_key
from ..deps import OrchestratorDep, SettingsDep
from ..listing import Cursor, paginate
from ..models import LIFECYCLE_ERRORS, ErrorBody, Sandbox
from ..wire import ApiRequest, ApiResponse
from .builds import BuilderDep, TemplateBuild
from .sandboxes import NEXT_TOKEN_HEADER, add_timing

router = APIRouter(
    tags=["snapshots"],
    dependencies=[Depends(require_api_key)],
    responses=LIFECYCLE_ERRORS,
)


# A template's diskSizeMB as E2B's API reports it (templates here record no disk size).
DEFAULT_DISK_MB = 1024


class SnapshotRequest(ApiRequest):
    name: str | None = Field(default=None, max_length=128)
    memory: bool | None = None


class SnapshotInfo(ApiResponse):
    """E2B's `SnapshotInfo` (`snapshotID`, `names`), and what tells snapshots apart: `mode`
    `full` (memory and processes: sandboxes made from it continue where it was) or
    `filesystem` (files only: they boot fresh), the source sandbox and when it was taken."""

    snapshot_id: str = Field(alias="snapshotID")
    names: list[str]
    mode: Literal["full", "filesystem"] | None = None
    sandbox_id: str | None = Field(default=None, alias="sandboxID")
    created_at: datetime | None = Field(default=None, alias="createdAt")

    @classmethod
    def of(cls, t: TemplateRecord) -> SnapshotInfo:
        return cls(
            snapshotID=t.template_id,
            names=t.names,
            mode="full" if t.has_memory else "filesystem",
            sandboxID=t.sandbox_id,
            createdAt=_when(t.created_at) if t.created_at else None,
        )


class ForkRequest(ApiRequest):
    count: int = Field(default=1, ge=1, le=20)
    timeout: int | None = Field(default=None, ge=0)


class ForkResultBody(ApiResponse):
    sandbox: Sandbox | None = None
    error: ErrorBody | None = None


class TemplateInfo(ApiResponse):
    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID")
    cpu_count: int = Field(alias="cpuCount")
    memory_mb: int = Field(alias="memoryMB")
    disk_size_mb: int = Field(alias="diskSizeMB")
    public: bool = False
    aliases: list[str]
    names: list[str]
    created_at: datetime = Field(alias="createdAt")
    updated_at: datetime = Field(alias="updatedAt")
    created_by: None = Field(default=None, alias="createdBy")
    last_spawned_at: datetime | None = Field(default=None, alias="lastSpawnedAt")
    spawn_count: int = Field(default=0, alias="spawnCount")
    build_count: int = Field(default=1, alias="buildCount")
    envd_version: str = Field(default=ENVD_VERSION, alias="envdVersion")
    build_status: str = Field(default="ready", alias="buildStatus")

    _KEEP_NULL: ClassVar[frozenset[str]] = frozenset({"createdBy", "lastSpawnedAt"})

    @classmethod
    def of(cls, t: TemplateRecord) -> TemplateInfo:
        created = _when(t.created_at)
        name = main_name(t)
        names = [name] if name else []
        return cls(
            templateID=t.template_id,
            buildID=build_id_of(t),
            cpuCount=t.cpu_count or 2,
            memoryMB=t.memory_mb or 512,
            diskSizeMB=DEFAULT_DISK_MB,
            aliases=names,
            names=names,
            createdAt=created,
            updatedAt=created,
            buildStatus=t.build.status or "ready",
        )


def _when(value: object) -> datetime:
    if isinstance(value, str):
        with_tz = datetime.fromisoformat(value)
        return with_tz if with_tz.tzinfo else with_tz.replace(tzinfo=UTC)
    return datetime.now(UTC)


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201, summary="Snapshot a sandbox")
async def create_snapshot(
    sandbox_id: str,
    response: Response,
    orchestrator: OrchestratorDep,
    body: SnapshotRequest | None = None,
) -> SnapshotInfo:
    body = body or SnapshotRequest()
    timings = Timings()
    snap = await orchestrator.snapshotter.snapshot(
        sandbox_id, body.name, timings=timings, memory=body.memory is not False
    )
    add_timing(response, timings)
    return SnapshotInfo.of(snap)


@router.get("/snapshots", summary="List snapshots")
async def list_snapshots(
    response: Response,
    orchestrator: OrchestratorDep,
    sandbox_id: str | None = Query(default=None, alias="sandboxID"),
    name: str | None = None,
    limit: int = Query(default=100, ge=1, le=1000),
    next_token: str | None = Query(default=None, alias="nextToken"),
) -> list[SnapshotInfo]:
    items = await orchestrator.templates.snapshots(sandbox_id=sandbox_id, name=name)
    cursor = Cursor.decode(next_token) if next_token else None
    page, token = paginate(items, order="asc", limit=limit, cursor=cursor, key=_snapshot_key)
    if token is not None:
        response.headers[NEXT_TOKEN_HEADER] = token
    return [SnapshotInfo.of(t) for t in page]


@router.get(
    "/snapshots/{snapshot_id:path}",
    summary="Get a snapshot",
    responses={404: {"model": ErrorBody}},
)
async def get_snapshot(snapshot_id: str, orchestrator: OrchestratorDep) -> SnapshotInfo:
    return SnapshotInfo.of(await orchestrator.templates.get_snapshot(snapshot_id))


def _snapshot_key(t: TemplateRecord) -> tuple[datetime, str]:
    return (_when(t.created_at), t.template_id)


async def _snapshot_or_none(orchestrator: Orchestrator, id_or_name: str) -> TemplateRecord | None:
    try:
        found = await orchestrator.templates.get(id_or_name)
    except NotFound:
        return None
    return found if found.kind is TemplateKind.SNAPSHOT and not found.internal else None


@router.post(
    "/sandboxes/{sandbox_id}/fork", status_code=201, summary="Fork a running or paused sandbox"
)
async def fork_sandbox(
    sandbox_id: str,
    request: Request,
    response: Response,
    orchestrator: OrchestratorDep,
    settings: SettingsDep,
    body: ForkRequest | None = None,
) -> list[ForkResultBody]:
    body = body or ForkRequest()
    timings = Timings()
    if orchestrator.table.find(sandbox_id) is None and (
        snapshot := await _snapshot_or_none(orchestrator, sandbox_id)
    ):
        # aenv's: a snapshot's id or name in place of a sandbox's makes `count` sandboxes
        # from it in one call (docs/fork-tree.md), answered as a fork's children.
        results = await orchestrator.forker.from_snapshot(
            snapshot, body.count, body.timeout, key_name(request)
        )
    else:
        results = await orchestrator.forker.fork(
            sandbox_id, body.count, body.timeout, timings=timings
        )
    add_timing(response, timings)
    out = []
    for r in results:
        if r.sandbox is not None:
            out.append(ForkResultBody(sandbox=Sandbox.from_record(r.sandbox, settings.domain)))
        else:
            err = r.error
            assert err is not None
            out.append(ForkResultBody(error=ErrorBody(code=err.status, message=err.message)))
    return out


def _with_builds(info: TemplateInfo, builds: list[BuildRecord]) -> TemplateInfo:
    """The template as its newest build shows it (a rebuild in flight: `building`)."""
    if builds and builds[0].status in ("building", "waiting"):
        info.build_status = builds[0].status
        info.build_id = builds[0].build_id
    info.build_count = max(1, len(builds))
    return info


def _pending_info(b: BuildRecord) -> TemplateInfo:
    """A template that exists only as builds (the first one in flight, or failed)."""
    names = b.names[:1]
    created = datetime.fromtimestamp(b.created, UTC)
    return TemplateInfo(
        templateID=b.template_id,
        buildID=b.build_id,
        cpuCount=b.cpu_count or 2,
        memoryMB=b.memory_mb or 512,
        diskSizeMB=1024,
        aliases=names,
        names=names,
        createdAt=created,
        updatedAt=datetime.fromtimestamp(b.updated, UTC),
        buildStatus=b.status,
    )


@router.get("/templates", summary="List templates")
async def list_templates(orchestrator: OrchestratorDep, builder: BuilderDep) -> list[TemplateInfo]:
    templates = await orchestrator.templates.all()
    by_template = await asyncio.to_thread(builder.by_template)
    out = []
    for t in templates:
        if t.internal or t.pinned_of:
            continue  # a build kept for its tags is not a template of its own
        out.append(_with_builds(TemplateInfo.of(t), by_template.pop(t.template_id, [])))
    out.extend(_pending_info(bs[0]) for bs in by_template.values())
    return out


# The templates every node makes itself (E2B's default templates are its public ones: the
# base image and the code interpreter's).
DEFAULT_TEMPLATES = ("base", "code-interpreter-v1")


@router.get("/default-templates", summary="List the templates every node provides")
async def default_templates(orchestrator: OrchestratorDep) -> list[TemplateInfo]:
    out = []
    for name in DEFAULT_TEMPLATES:
        found = await orchestrator.templates.find(name)
        if found is not None and not found.internal and found.template_id == name:
            info = TemplateInfo.of(found)
            info.public = True
            out.append(info)
    return out


@router.get("/v2/templates", summary="List templates (paginated)")
async def list_templates_v2(
    response: Response,
    orchestrator: OrchestratorDep,
    builder: BuilderDep,
    limit: int = Query(default=100, ge=1, le=1000),
    next_token: str | None = Query(default=None, alias="nextToken"),
    team_id: str | None = Query(default=None, alias="teamID"),  # one team here
) -> list[TemplateInfo]:
    items = await list_templates(orchestrator, builder)
    cursor = Cursor.decode(next_token) if next_token else None
    page, token = paginate(items, order="asc", limit=limit, cursor=cursor, key=_template_key)
    if token is not None:
        response.headers[NEXT_TOKEN_HEADER] = token
    return page


def _template_key(t: TemplateInfo) -> tuple[datetime, str]:
    return (t.created_at, t.template_id)


@router.get(
    "/templates/aliases/{alias:path}",
    summary="Resolve a template alias",
    responses={404: {"model": ErrorBody}},
)
async def template_alias(
    alias: str, orchestrator: OrchestratorDep, builder: BuilderDep
) -> dict[str, Any]:
    found = await orchestrator.templates.find(alias)
    if found is not None and not found.internal:
        return {"templateID": owner_of(found), "public": False}
    for b in await asyncio.to_thread(builder.pending_templates):
        if alias in b.names:
            return {"templateID": b.template_id, "public": False}
    raise NotFound(f"template alias {alias!r} not found")


@router.get("/templates/{template_id:path}", summary="Get a template")
async def get_template(
    template_id: str, orchestrator: OrchestratorDep, builder: BuilderDep
) -> dict[str, Any]:
    found = await orchestrator.templates.find(template_id)
    if found is not None and not found.internal:
        builds = await asyncio.to_thread(builder.builds, found.template_id)
        info = _with_builds(TemplateInfo.of(found), builds)
    else:
        pending = [
            b
            for b in await asyncio.to_thread(builder.pending_templates)
            if template_id in (b.template_id, *b.names)
        ]
        if not pending:
            raise NotFound(f"template {template_id!r} not found")
        builds = await asyncio.to_thread(builder.builds, pending[0].template_id)
        info = _pending_info(pending[0])
    body = info.model_dump(by_alias=True, mode="json")
    return {**body, "builds": [TemplateBuild.of(b).model_dump(mode="json") for b in builds]}


class TemplateUpdate(ApiRequest):
    """E2B's `TemplateUpdateRequest` (`public`: one team here, so accepted and moot) and
    aenv's lifecycle setting: `standbyAfter` seconds idle before standby for the template's
    sandboxes that set none at create (null: the node's setting; 0: never)."""

    public: bool | None = None
    standby_after: float | None = Field(default=None, alias="standbyAfter", ge=0)


@router.patch("/templates/{template_id:path}", summary="Update a template's settings")
async def update_template(
    template_id: str, body: TemplateUpdate, orchestrator: OrchestratorDep
) -> dict[str, Any]:
    found = await orchestrator.templates.find(template_id)
    if found is None or found.internal:
        raise NotFound(f"template {template_id!r} not found")
    rec = found
    if "standby_after" in body.model_fields_set:
        rec = await orchestrator.templates.set_standby(found.template_id, body.standby_after)
    return {"templateID": owner_of(rec), "standbyAfter": rec.standby_after}


class TemplateUpdated(ApiResponse):
    """E2B's `TemplateUpdateResponse`: the template's names."""

    names: list[str]


@router.patch("/v2/templates/{template_id:path}", summary="Update a template's settings (v2)")
async def update_template_v2(
    template_id: str, body: TemplateUpdate, orchestrator: OrchestratorDep
) -> TemplateUpdated:
    await update_template(template_id, body, orchestrator)
    found = await orchestrator.templates.find(template_id)
    assert found is not None  # update_template found it
    return TemplateUpdated(names=TemplateInfo.of(found).names)


@router.delete(
    "/templates/{template_id:path}",
    status_code=204,
    response_class=Response,
    summary="Delete a template or snapshot (cancels its builds)",
)
async def delete_template(
    template_id: str, orchestrator: OrchestratorDep, builder: BuilderDep
) -> Response:
    found = await orchestrator.templates.find(template_id)
    if found is not None:
        template_id = owner_of(found)  # `name:tag`: the whole template
        await builder.tags.forget(template_id)
    had_builds = await builder.delete_template(template_id)
    if found is not None or not had_builds:
        await orchestrator.delete_template(template_id)
    return Response(status_code=204)
