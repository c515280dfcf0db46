"""The fork tree's JSON (aenv's, docs/fork-tree.md; the E2B SDKs ignore it): lineage in
`GET /sandboxes/{id}` and `/lineage`, and the diff, apply and rollback routes' bodies."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from aenv.domain import Lineage
from aenv.images.treediff import Change

from .wire import ApiRequest, ApiResponse, ApiState


class LineageInfo(ApiResponse):
    """Where a sandbox came from (aenv's, docs/fork-tree.md; the E2B SDKs ignore it)."""

    template_id: str | None = Field(default=None, alias="templateID")
    snapshot_id: str | None = Field(default=None, alias="snapshotID")
    snapshot_of: str | None = Field(default=None, alias="snapshotOf")
    parent_id: str | None = Field(default=None, alias="parentID")
    fork_point: str | None = Field(default=None, alias="forkPoint")

    @classmethod
    def of(cls, lineage: Lineage) -> LineageInfo:
        return cls(
            templateID=lineage.template_id,
            snapshotID=lineage.snapshot_id,
            snapshotOf=lineage.snapshot_of,
            parentID=lineage.parent_id,
            forkPoint=lineage.fork_point,
        )


class LineageAncestor(ApiResponse):
    sandbox_id: str = Field(alias="sandboxID")
    state: Literal["running", "paused", "killed"]
    lineage: LineageInfo | None = None  # unknown for a killed one


class LineageDescendant(ApiResponse):
    sandbox_id: str = Field(alias="sandboxID")
    state: ApiState
    lineage: LineageInfo
    children: list[LineageDescendant] = Field(default_factory=list)


class LineageTreeInfo(ApiResponse):
    """`GET /sandboxes/{id}/lineage`: ancestors oldest first, live descendants as a tree."""

    sandbox_id: str = Field(alias="sandboxID")
    lineage: LineageInfo
    ancestors: list[LineageAncestor]
    descendants: list[LineageDescendant]


class ChangeInfo(ApiResponse):
    path: str
    change: Literal["added", "changed", "deleted"]
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int

    @classmethod
    def of(cls, c: Change) -> ChangeInfo:
        return cls(path=c.path, change=c.change, type=c.type, size=c.size, mode=c.mode)


class ApplyRequest(ApiRequest):
    source: str = Field(alias="from", min_length=1)
    base: str | None = None
    paths: list[str] = Field(default_factory=list, max_length=10_000)
    exclude: list[str] = Field(default_factory=list, max_length=1_000)
    default_excludes: bool = Field(default=True, alias="defaultExcludes")
    strategy: Literal["ours", "theirs"] | None = None


class RollbackRequest(ApiRequest):
    snapshot_id: str = Field(alias="snapshotID", min_length=1)


class RollbackResult(ApiResponse):
    sandbox_id: str = Field(alias="sandboxID")
    snapshot_id: str = Field(alias="snapshotID")


class ApplyResult(ApiResponse):
    applied: list[ChangeInfo]
    conflicts: list[str]
