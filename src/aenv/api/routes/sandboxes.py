"""E2B sandbox lifecycle routes: /sandboxes (v1) and /v2/sandboxes.

Every route is a thin translation: validate the body (models.py), call one Orchestrator
method, shape the record into E2B JSON. Errors are raised, never formatted here.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from pydantic import BeforeValidator

from aenv.builds.builder import Builder
from aenv.config import Settings
from aenv.domain import SandboxRecord, Timings
from aenv.errors import Conflict, NotFound
from aenv.orchestrator import Orchestrator, check_timeout
from aenv.secretstore import SecretStore

from ..auth import key_name, require_api_key
from ..deps import IdempotencyDep, OrchestratorDep, SecretsDep, SettingsDep
from ..idempotency import IdempotencyCache, validate_key
from ..listing import Cursor, aware, paginate, parse_metadata_filter, parse_states, rfc3339
from ..models import (
    LIFECYCLE_ERRORS,
    ApiState,
    ConnectSandbox,
    ConnectSandboxV2,
    ListedSandbox,
    NetworkUpdate,
    NewSandbox,
    NewSandboxV2,
    PauseBody,
    RefreshBody,
    ResumedSandbox,
    Sandbox,
    SandboxDetail,
    TimeoutBody,
    api_state,
    check_secrets,
)
from .builds import BuilderDep

router = APIRouter(
    tags=["sandboxes"], dependencies=[Depends(require_api_key)], responses=LIFECYCLE_ERRORS
)

NEXT_TOKEN_HEADER = "x-next-token"
# Running sandboxes matching a v2 listing's filters, before paging; only when running ones
# were asked for (E2B's XTotalRunning).
TOTAL_RUNNING_HEADER = "X-Total-Running"
SERVER_TIMING_HEADER = "Server-Timing"


# --------------------------------------------------------------------------------------------
# helpers


def _visible_state(record: SandboxRecord) -> ApiState:
    state = api_state(record)
    if state is None:
        raise NotFound(f"sandbox {record.sandbox_id} not found")
    return state


def add_timing(response: Response, timings: Timings) -> None:
    """`Server-Timing` from the stages the orchestrator timed for this request, if any."""
    value = timings.header()
    if value:
        response.headers[SERVER_TIMING_HEADER] = value


def _listed(records: list[SandboxRecord], wanted: set[str]) -> list[tuple[SandboxRecord, ApiState]]:
    out = []
    for record in records:
        state = api_state(record)
        if state is not None and state in wanted:
            out.append((record, state))
    return out


# --------------------------------------------------------------------------------------------
# create


async def _create(
    body: NewSandboxV2,
    *,
    key: str | None,
    owner: str | None,
    response: Response,
    orchestrator: Orchestrator,
    settings: Settings,
    idempotency: IdempotencyCache,
    secrets: SecretStore,
    builder: Builder,
) -> Sandbox:
    check_timeout(body.timeout, settings)
    key = validate_key(key)
    req = body.to_request(owner, body.template_id)
    await check_secrets(req.egress, secrets)

    async def create() -> tuple[Sandbox, str]:
        timings = Timings()
        # The code interpreter's template may be in its first build (builds/autobuild.py).
        await builder.autobuild.before_create(req.template_id)
        try:
            record = await orchestrator.sandboxes.create(req, timings=timings)
        except NotFound as e:
            raise builder.autobuild.explain_missing(e, req.template_id) from None
        return Sandbox.from_record(record, settings.domain), timings.header()

    sandbox, timing = await idempotency.run(key, create)
    if timing:
        response.headers[SERVER_TIMING_HEADER] = timing
    return sandbox


IdempotencyKey = Annotated[
    str | None,
    Header(alias="Idempotency-Key", description="1-255 chars of [a-z0-9-]; retries reuse it"),
]


@router.post("/sandboxes", status_code=201, summary="Create a sandbox (v1)")
async def create_sandbox_v1(
    body: NewSandbox,
    request: Request,
    response: Response,
    orchestrator: OrchestratorDep,
    settings: SettingsDep,
    idempotency: IdempotencyDep,
    secrets: SecretsDep,
    builder: BuilderDep,
    idempotency_key: IdempotencyKey = None,
) -> Sandbox:
    # `secure` is accepted and ignored: every sandbox's envd wants its access token.
    return await _create(
        body,
        key=idempotency_key,
        owner=key_name(request),
        response=response,
        orchestrator=orchestrator,
        settings=settings,
        idempotency=idempotency,
        secrets=secrets,
        builder=builder,
    )


@router.post("/v2/sandboxes", status_code=201, summary="Create a sandbox")
async def create_sandbox_v2(
    body: NewSandboxV2,
    request: Request,
    response: Response,
    orchestrator: OrchestratorDep,
    settings: SettingsDep,
    idempotency: IdempotencyDep,
    secrets: SecretsDep,
    builder: BuilderDep,
    idempotency_key: IdempotencyKey = None,
) -> Sandbox:
    return await _create(
        body,
        key=idempotency_key,
        owner=key_name(request),
        response=response,
        orchestrator=orchestrator,
        settings=settings,
        idempotency=idempotency,
        secrets=secrets,
        builder=builder,
    )


# --------------------------------------------------------------------------------------------
# list / get


@router.get("/sandboxes", summary="List running sandboxes (v1, no pagination)")
async def list_sandboxes_v1(
    orchestrator: OrchestratorDep,
    metadata: Annotated[str | None, Query(description="urlencoded k=v&k2=v2")] = None,
) -> list[ListedSandbox]:
    wanted = {"running"}
    records = orchestrator.table.list(metadata=parse_metadata_filter(metadata), states=wanted)
    return [ListedSandbox.from_record(r, s) for r, s in _listed(records, wanted)]


@router.get("/v2/sandboxes", summary="List sandboxes")
async def list_sandboxes_v2(
    response: Response,
    orchestrator: OrchestratorDep,
    metadata: Annotated[str | None, Query(description="urlencoded k=v&k2=v2")] = None,
    state: Annotated[list[str] | None, Query(description="running,paused")] = None,
    template: Annotated[str | None, Query()] = None,
    started_after: Annotated[
        datetime | None, Query(alias="startedAfter"), BeforeValidator(rfc3339)
    ] = None,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    next_token: Annotated[str | None, Query(alias="nextToken")] = None,
) -> list[ListedSandbox]:
    wanted = parse_states(state or [])
    cursor = Cursor.decode(next_token) if next_token else None
    records = orchestrator.table.list(
        metadata=parse_metadata_filter(metadata),
        states=wanted,
        template=template or None,
    )
    if started_after is not None:
        after = aware(started_after)
        # Inclusive, as E2B: a sandbox started at that very instant is listed.
        records = [r for r in records if aware(r.started_at) >= after]
    visible = _listed(records, wanted)
    states = {r.sandbox_id: s for r, s in visible}
    page, token = paginate([r for r, _ in visible], order=order, limit=limit, cursor=cursor)
    if token:
        response.headers[NEXT_TOKEN_HEADER] = token
    if "running" in wanted:
        running = sum(1 for s in states.values() if s == "running")
        response.headers[TOTAL_RUNNING_HEADER] = str(running)
    return [ListedSandbox.from_record(r, states[r.sandbox_id]) for r in page]


@router.get("/sandboxes/{sandbox_id}", summary="Get a sandbox")
async def get_sandbox(
    sandbox_id: str, orchestrator: OrchestratorDep, settings: SettingsDep
) -> SandboxDetail:
    record = orchestrator.table.get(sandbox_id)
    return SandboxDetail.from_record(record, _visible_state(record), settings.domain)


# --------------------------------------------------------------------------------------------
# lifecycle


@router.delete("/sandboxes/{sandbox_id}", status_code=204, response_class=Response, summary="Kill")
async def kill_sandbox(sandbox_id: str, orchestrator: OrchestratorDep) -> Response:
    await orchestrator.sandboxes.kill(sandbox_id)
    return Response(status_code=204)


@router.post(
    "/sandboxes/{sandbox_id}/timeout",
    status_code=204,
    response_class=Response,
    summary="Set the timeout (seconds from now)",
)
async def set_timeout(
    sandbox_id: str, body: TimeoutBody, orchestrator: OrchestratorDep, settings: SettingsDep
) -> Response:
    check_timeout(body.timeout, settings)
    await orchestrator.sandboxes.set_timeout(sandbox_id, body.timeout)
    return Response(status_code=204)


@router.put(
    "/sandboxes/{sandbox_id}/network",
    status_code=204,
    response_class=Response,
    summary="Replace a sandbox's egress rules (omitted fields are cleared)",
)
async def update_network(
    sandbox_id: str, body: NetworkUpdate, orchestrator: OrchestratorDep, secrets: SecretsDep
) -> Response:
    policy = body.policy(body.allow_internet_access)
    if policy.intercepts:  # the sandbox's owner's secrets, not the caller's
        owner = orchestrator.table.get(sandbox_id).owner
        await check_secrets(replace(policy, owner=owner), secrets)
    await orchestrator.sandboxes.update_network(sandbox_id, policy)
    return Response(status_code=204)


@router.post(
    "/sandboxes/{sandbox_id}/refreshes",
    status_code=204,
    response_class=Response,
    summary="Keep alive (legacy)",
)
async def refresh(
    sandbox_id: str, orchestrator: OrchestratorDep, body: RefreshBody | None = None
) -> Response:
    await orchestrator.sandboxes.refresh(sandbox_id, body.duration if body else None)
    return Response(status_code=204)


async def _connect(
    sandbox_id: str,
    ttl: int | None,
    memory: bool | None,
    response: Response,
    orchestrator: Orchestrator,
    settings: Settings,
) -> Sandbox:
    check_timeout(ttl, settings)
    timings = Timings()
    record, resumed = await orchestrator.pauser.connect(sandbox_id, ttl, memory, timings=timings)
    response.status_code = 201 if resumed else 200
    add_timing(response, timings)
    return Sandbox.from_record(record, settings.domain)


_CONNECT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": Sandbox, "description": "The sandbox was already running"},
    201: {"model": Sandbox, "description": "The sandbox was resumed"},
}


@router.post(
    "/sandboxes/{sandbox_id}/connect",
    responses=_CONNECT_RESPONSES,
    summary="Connect, resuming if paused (v1)",
)
async def connect_v1(
    sandbox_id: str,
    body: ConnectSandbox,
    response: Response,
    orchestrator: OrchestratorDep,
    settings: SettingsDep,
) -> Sandbox:
    return await _connect(sandbox_id, body.timeout, body.memory, response, orchestrator, settings)


@router.post(
    "/v2/sandboxes/{sandbox_id}/connect",
    responses=_CONNECT_RESPONSES,
    summary="Connect, resuming if paused",
)
async def connect_v2(
    sandbox_id: str,
    response: Response,
    orchestrator: OrchestratorDep,
    settings: SettingsDep,
    body: ConnectSandboxV2 | None = None,
) -> Sandbox:
    body = body or ConnectSandboxV2()
    return await _connect(sandbox_id, body.timeout, body.memory, response, orchestrator, settings)


@router.post(
    "/sandboxes/{sandbox_id}/pause", status_code=204, response_class=Response, summary="Pause"
)
async def pause_sandbox(
    sandbox_id: str,
    orchestrator: OrchestratorDep,
    body: PauseBody | None = None,
) -> Response:
    memory = body.memory if body is not None and body.memory is not None else True
    strict = body is not None and body.require_healthy_guest is True
    timings = Timings()
    await orchestrator.pauser.pause(
        sandbox_id, memory=memory, timings=timings, require_healthy_guest=strict
    )
    response = Response(status_code=204)
    add_timing(response, timings)
    return response


@router.post(
    "/sandboxes/{sandbox_id}/resume", status_code=201, summary="Resume a paused sandbox (legacy)"
)
async def resume_sandbox(
    sandbox_id: str,
    response: Response,
    orchestrator: OrchestratorDep,
    settings: SettingsDep,
    body: ResumedSandbox | None = None,
) -> Sandbox:
    body = body or ResumedSandbox()
    check_timeout(body.timeout, settings)
    record = orchestrator.table.get(sandbox_id)
    if _visible_state(record) == "running":
        raise Conflict(f"sandbox {sandbox_id} is already running")
    # TODO: `autoPause` (change the on-timeout action) needs an orchestrator setter.
    timings = Timings()
    record, _ = await orchestrator.pauser.connect(
        sandbox_id, body.timeout, body.memory, timings=timings
    )
    response.status_code = 201
    add_timing(response, timings)
    return Sandbox.from_record(record, settings.domain)
