"""Secrets (E2B's `/secrets`): created, listed, read, updated and deleted by the API key
that owns them, their values write-only. A value comes in on create and update and leaves
this node only in the header of an egress request the sandbox's rules name it in
(`${e2b.secrets.NAME}`, docs/secrets.md); no answer carries it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import Field

from aenv.secretstore import SecretInfo as StoredSecret

from ..auth import key_name, require_api_key
from ..deps import SecretsDep
from ..listing import Cursor, paginate
from ..models import ErrorBody
from ..wire import ApiRequest, ApiResponse
from .sandboxes import NEXT_TOKEN_HEADER

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody} for status in (400, 401, 404, 409, 500)
}
router = APIRouter(tags=["secrets"], dependencies=[Depends(require_api_key)], responses=_ERRORS)


class NewSecret(ApiRequest):
    """E2B's NewSecret: the name is checked by the store (letters, digits, `_`, `-`)."""

    name: str = Field(min_length=1, max_length=128)
    value: str
    metadata: dict[str, str] | None = None


class SecretUpdate(ApiRequest):
    """E2B's SecretUpdate: a new value; metadata, when given, replaces the stored one."""

    value: str
    metadata: dict[str, str] | None = None


class Secret(ApiResponse):
    """E2B's Secret: metadata only, never the value."""

    secret_id: str = Field(alias="secretID")
    name: str
    current_version: int = Field(alias="currentVersion")
    metadata: dict[str, str]
    created_at: datetime = Field(alias="createdAt")
    updated_at: datetime = Field(alias="updatedAt")

    @classmethod
    def of(cls, s: StoredSecret) -> Secret:
        return cls(
            secretID=s.secret_id,
            name=s.name,
            currentVersion=s.version,
            metadata=dict(s.metadata),
            createdAt=s.created_at,
            updatedAt=s.updated_at,
        )


def _key(s: StoredSecret) -> tuple[datetime, str]:
    return (s.created_at, s.secret_id)


@router.get("/secrets", summary="List the API key's secrets (never their values)")
async def list_secrets(
    request: Request,
    response: Response,
    secrets: SecretsDep,
    limit: int = Query(default=100, ge=1, le=100),
    next_token: str | None = Query(default=None, alias="nextToken"),
) -> list[Secret]:
    cursor = Cursor.decode(next_token) if next_token else None
    await secrets.refreshed()
    items = secrets.listed(key_name(request))
    page, token = paginate(items, order="asc", limit=limit, cursor=cursor, key=_key)
    if token is not None:
        response.headers[NEXT_TOKEN_HEADER] = token
    return [Secret.of(s) for s in page]


@router.post("/secrets", status_code=201, summary="Create a secret")
async def create_secret(body: NewSecret, request: Request, secrets: SecretsDep) -> Secret:
    await secrets.refreshed()  # a name taken through another node of the cluster
    info = await secrets.create(key_name(request), body.name, body.value, body.metadata)
    return Secret.of(info)


@router.get("/secrets/{secret_id}", summary="Get a secret's metadata (by id or name)")
async def get_secret(secret_id: str, request: Request, secrets: SecretsDep) -> Secret:
    await secrets.refreshed()
    return Secret.of(secrets.get(key_name(request), secret_id))


@router.post("/secrets/{secret_id}", summary="Update a secret (a new version of its value)")
async def update_secret(
    secret_id: str, body: SecretUpdate, request: Request, secrets: SecretsDep
) -> Secret:
    await secrets.refreshed()
    info = await secrets.update(key_name(request), secret_id, body.value, body.metadata)
    return Secret.of(info)


@router.delete("/secrets/{secret_id}", status_code=204, summary="Delete a secret")
async def delete_secret(secret_id: str, request: Request, secrets: SecretsDep) -> Response:
    await secrets.refreshed()
    await secrets.delete(key_name(request), secret_id)
    return Response(status_code=204)
