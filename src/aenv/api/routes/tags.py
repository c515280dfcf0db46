"""Template tags (E2B's `Template.assign_tags`, `remove_tags`, `get_tags`) and the tag
sub-routes of SDK 2.63's API (`tags/count`, `tags/exists`, `tags/groups`,
`tags/{tag}/assignments`); the logic is in builds/tags.py and builds/tag_history.py.
Included before snapshots.py, whose `/templates/{id:path}` routes would otherwise take these
paths."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, ClassVar

from fastapi import APIRouter, Depends, Query, Response
from pydantic import Field

from aenv.builds.tag_history import AssignmentEvent, GroupSort, count, groups, normalized, page

from ..auth import require_api_key
from ..models import ErrorBody
from ..wire import ApiRequest, ApiResponse
from .builds import BuilderDep

router = APIRouter(
    tags=["tags"],
    dependencies=[Depends(require_api_key)],
    responses={s: {"model": ErrorBody} for s in (400, 401, 404, 500)},
)


class AssignTagsRequest(ApiRequest):
    target: str = Field(min_length=1, max_length=256)
    tags: list[str] = Field(min_length=1, max_length=64)


class AssignedTags(ApiResponse):
    tags: list[str]
    build_id: str = Field(alias="buildID")


class DeleteTagsRequest(ApiRequest):
    name: str = Field(min_length=1, max_length=256)
    tags: list[str] = Field(min_length=1, max_length=64)


class TemplateTag(ApiResponse):
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


class TemplateTagsCount(ApiResponse):
    total: int


class TemplateTagExists(ApiResponse):
    exists: bool
    normalized_tag: str = Field(alias="normalizedTag")


class TemplateTagAssignment(ApiResponse):
    """One time a tag was pointed at a ready build (E2B spells these ids `Id`)."""

    _KEEP_NULL: ClassVar[frozenset[str]] = frozenset({"buildFinishedAt"})

    assignment_id: str = Field(alias="assignmentId")
    build_id: str = Field(alias="buildId")
    assigned_at: datetime = Field(alias="assignedAt")
    build_created_at: datetime = Field(alias="buildCreatedAt")
    build_finished_at: datetime | None = Field(alias="buildFinishedAt")

    @classmethod
    def of(cls, e: AssignmentEvent) -> TemplateTagAssignment:
        finished = e.build_finished_at
        return cls(
            assignmentId=e.assignment_id,
            buildId=e.build_id,
            assignedAt=datetime.fromtimestamp(e.assigned_at, UTC),
            buildCreatedAt=datetime.fromtimestamp(e.build_created_at, UTC),
            buildFinishedAt=None if finished is None else datetime.fromtimestamp(finished, UTC),
        )


class TemplateTagGroup(ApiResponse):
    tag: str
    assignments: list[TemplateTagAssignment]
    has_more: bool = Field(alias="hasMore")


class TemplateTagGroups(ApiResponse):
    _KEEP_NULL: ClassVar[frozenset[str]] = frozenset({"nextCursor"})

    tags: list[TemplateTagGroup]
    next_cursor: str | None = Field(alias="nextCursor")


class TemplateTagAssignments(ApiResponse):
    _KEEP_NULL: ClassVar[frozenset[str]] = frozenset({"nextCursor"})

    data: list[TemplateTagAssignment]
    next_cursor: str | None = Field(alias="nextCursor")


@router.get("/templates/{template_id:path}/tags/count", summary="Count a template's tags")
async def count_tags(template_id: str, builder: BuilderDep) -> TemplateTagsCount:
    return TemplateTagsCount(total=count(await builder.tag_events(template_id)))


@router.get("/templates/{template_id:path}/tags/exists", summary="Whether a template has a tag")
async def tag_exists(
    template_id: str, builder: BuilderDep, tag: Annotated[str, Query(max_length=256)]
) -> TemplateTagExists:
    want = normalized(tag)
    found = any(e.tag == want for e in await builder.tag_events(template_id))
    return TemplateTagExists(exists=found, normalizedTag=want)


@router.get(
    "/templates/{template_id:path}/tags/groups",
    summary="A template's tags, each with its latest assignments",
)
async def tag_groups(
    template_id: str,
    builder: BuilderDep,
    assignment_limit: Annotated[int, Query(alias="assignmentLimit", ge=1, le=100)] = 6,
    tags_limit: Annotated[int, Query(alias="tagsLimit", ge=1, le=100)] = 25,
    tags_cursor: Annotated[str | None, Query(alias="tagsCursor", max_length=256)] = None,
    search: Annotated[str | None, Query(max_length=256)] = None,
    sort: GroupSort = "latest_desc",
) -> TemplateTagGroups:
    chosen, next_cursor = groups(
        await builder.tag_events(template_id),
        sort=sort,
        search=search,
        tags_limit=tags_limit,
        tags_cursor=tags_cursor,
        assignment_limit=assignment_limit,
    )
    return TemplateTagGroups(
        tags=[
            TemplateTagGroup(
                tag=g.tag,
                assignments=[TemplateTagAssignment.of(e) for e in g.assignments],
                hasMore=g.has_more,
            )
            for g in chosen
        ],
        nextCursor=next_cursor,
    )


@router.get(
    "/templates/{template_id:path}/tags/{tag}/assignments",
    summary="A tag's assignments, newest first",
)
async def tag_assignments(
    template_id: str,
    tag: str,
    builder: BuilderDep,
    cursor: Annotated[str | None, Query(max_length=256)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 50,
) -> TemplateTagAssignments:
    want = normalized(tag)
    mine = [e for e in await builder.tag_events(template_id) if e.tag == want]
    chosen, next_cursor = page(mine, cursor, limit)
    return TemplateTagAssignments(
        data=[TemplateTagAssignment.of(e) for e in chosen], nextCursor=next_cursor
    )
