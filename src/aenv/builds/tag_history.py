"""A template's tag history as E2B's tag sub-routes show it: how many tags (`tags/count`),
whether one exists (`tags/exists`), tags grouped with their latest assignments
(`tags/groups`) and one tag's assignments (`tags/{tag}/assignments`).

An assignment is one time a tag was pointed at a build (store.py records each); only ready
builds count, as in E2B: a build in flight holds its tags (`GET /templates/{id}/tags`) but
has no assignment yet. A tag set before assignments were recorded (a builds.db from an
earlier version, a template seeded from its catalog record) shows its current assignment.
Pages are cut by an opaque cursor: the offset of the next item, as tags are few.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, TypeVar

from ..domain import TemplateRecord
from ..errors import BadRequest
from .store import BuildRecord, TagAssignment, TagRow
from .tags import TAG_RE, build_id_of

GroupSort = Literal["latest_asc", "latest_desc", "name_asc", "name_desc"]
_T = TypeVar("_T")
_NS = uuid.UUID("6b0f3f5e-2f7e-4c55-9a3c-5e0d2c7b9a41")


@dataclass(frozen=True)
class AssignmentEvent:
    assignment_id: str
    tag: str
    build_id: str
    assigned_at: float
    build_created_at: float
    build_finished_at: float | None


@dataclass(frozen=True)
class TagGroup:
    tag: str
    assignments: list[AssignmentEvent]
    has_more: bool


def _epoch(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


def events(
    template_id: str,
    rows: list[TagRow],
    recorded: list[TagAssignment],
    builds: list[BuildRecord],
    records: dict[str, TemplateRecord],
) -> list[AssignmentEvent]:
    """The template's ready assignments, newest first. `rows`: its tags now; `recorded`:
    the store's assignments; `builds`: its build-API builds; `records`: its catalog records
    by build id (what a template made without the build API has)."""
    by_build = {b.build_id: b for b in builds}
    seen_tags = {a.tag for a in recorded}
    # A tag with no recorded assignment: its current one, under a stable id.
    implied = [
        TagAssignment(
            str(uuid.uuid5(_NS, f"{template_id}/{r.tag}/{r.build_id}/{r.created}")),
            r.tag,
            r.build_id,
            r.created,
        )
        for r in rows
        if r.tag not in seen_tags
    ]
    out: list[AssignmentEvent] = []
    for a in [*recorded, *implied]:
        b = by_build.get(a.build_id)
        rec = records.get(a.build_id)
        if b is not None and b.status == "ready":
            created, finished = b.created, b.finished if b.finished is not None else b.updated
        elif rec is not None and build_id_of(rec) == a.build_id:
            at = _epoch(rec.created_at)
            created = at if at is not None else a.assigned
            finished = created
        else:
            continue  # not a ready build (failed, or gone with no record left)
        out.append(
            AssignmentEvent(a.assignment_id, a.tag, a.build_id, a.assigned, created, finished)
        )
    out.sort(key=lambda e: (-e.assigned_at, e.assignment_id))
    return out


def normalized(tag: str) -> str:
    """A tag as the tag table keys it (surrounding blanks dropped); BadRequest if no tag
    could be spelled so."""
    tag = tag.strip()
    if not TAG_RE.match(tag):
        raise BadRequest(f"invalid tag {tag!r}: use letters, digits and _.- (max 64 chars)")
    return tag


def count(evs: list[AssignmentEvent]) -> int:
    return len({e.tag for e in evs})


def _offset(cursor: str | None) -> int:
    if not cursor:
        return 0
    try:
        kind, _, n = base64.urlsafe_b64decode(cursor.encode()).decode().partition(":")
        if kind == "o" and n.isdigit():
            return int(n)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    raise BadRequest("invalid cursor")


def _cursor(offset: int) -> str:
    return base64.urlsafe_b64encode(f"o:{offset}".encode()).decode()


def page(items: list[_T], cursor: str | None, limit: int) -> tuple[list[_T], str | None]:
    """One page of `items` after `cursor`, and the next page's cursor (None on the last)."""
    start = _offset(cursor)
    end = start + limit
    return items[start:end], (_cursor(end) if end < len(items) else None)


def groups(
    evs: list[AssignmentEvent],
    *,
    sort: GroupSort,
    search: str | None,
    tags_limit: int,
    tags_cursor: str | None,
    assignment_limit: int,
) -> tuple[list[TagGroup], str | None]:
    """Tags (matching `search`, a case-insensitive part of the name) with their latest
    `assignment_limit` assignments, sorted by name or by their latest assignment."""
    per_tag: dict[str, list[AssignmentEvent]] = {}
    for e in evs:  # newest first, so each tag's list is too
        per_tag.setdefault(e.tag, []).append(e)
    wanted = (search or "").strip().lower()
    tags = [t for t in per_tag if wanted in t.lower()]
    if sort.startswith("name"):
        tags.sort(reverse=sort == "name_desc")
    else:
        tags.sort(key=lambda t: (per_tag[t][0].assigned_at, t), reverse=sort == "latest_desc")
    chosen, next_cursor = page(tags, tags_cursor, tags_limit)
    return [
        TagGroup(t, per_tag[t][:assignment_limit], len(per_tag[t]) > assignment_limit)
        for t in chosen
    ], next_cursor
