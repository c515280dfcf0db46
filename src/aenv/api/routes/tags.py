"""Template tags (E2B's `Template.assign_tags`, `remove_tags`, `get_tags`); the logic is in
builds/tags.py. Included before snapshots.py, whose `/templates/{id:path}` routes would
otherwise take these paths."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, Depends, Response
from pydantic import Field

from ..auth import require_api_key
from ..models import ErrorBody, _Request, _Response
from .builds import BuilderDep

router = APIRouter(
    tags=["tags"],
    dependencies=[Depends(require_api_key)],
    responses={s: {"model": ErrorBody} for s in (400, 401, 404, 500)},
)


class AssignTagsRequest(_Request):
    target: str = Field(min_length=1, max_length=256)
    tags: list[str] = Field(min_length=1, max_length=64)


class AssignedTags(_Response):
    tags: list[str]
    build_id: str = Field(alias="buildID")


class DeleteTagsRequest(_Request):
    name: str = Field(min_length=1, max_length=256)
    tags: list[str] = Field(min_length=1, max_length=64)


class TemplateTag(_Response):
    tag: str
    build_id: str = Field(alias="buildID")
    created_at: datetime = Field(alias="createdAt")


@router.post("/templates/tags", status_code=201, summary="Assign tags to a template build")
async def assign_tags(body: AssignTagsRequest, builder: BuilderDep) -> AssignedTags:
    build_id, tags = await builder.assign_tags(body.target, body.tags)
    return AssignedTags(tags=tags, buildID=build_id)


@router.delete(
    "/templates/tags",
    status_code=204,
    response_class=Response,
    summary="Remove tags from a template",
)
async def delete_tags(body: DeleteTagsRequest, builder: BuilderDep) -> Response:
    await builder.remove_tags(body.name, body.tags)
    return Response(status_code=204)


@router.get("/templates/{template_id:path}/tags", summary="List a template's tags")
async def list_tags(template_id: str, builder: BuilderDep) -> list[TemplateTag]:
    return [
        TemplateTag(tag=tag, buildID=bid, createdAt=datetime.fromtimestamp(at, UTC))
        for tag, bid, at in await builder.get_tags(template_id)
    ]
