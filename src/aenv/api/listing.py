"""Query parsing and cursor pagination for `GET /sandboxes` and `GET /v2/sandboxes`."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Literal, TypeVar
from urllib.parse import parse_qsl, unquote

from aenv.domain import SandboxRecord
from aenv.errors import BadRequest
from aenv.paging import Cursor, aware

Order = Literal["asc", "desc"]
T = TypeVar("T")
API_STATES = ("running", "paused")


# RFC 3339 as E2B takes it (a date alone or a bare number is not a time): pydantic alone
# would read `startedAfter=0.5` as a Unix timestamp.
_RFC3339 = re.compile(
    r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?([Zz]|[+-]\d{2}(:?\d{2})?)?"
)


def rfc3339(value: object) -> object:
    """A pydantic before-validator for date-time query parameters."""
    if isinstance(value, str) and not _RFC3339.fullmatch(value):
        raise ValueError("must be an RFC 3339 date-time such as 2025-01-01T00:00:00Z")
    return value


def parse_metadata_filter(raw: str | None) -> dict[str, str] | None:
    """`metadata=k%3Dv%26k2%3Dv2` arrives here as `k=v&k2=v2`.

    The Python SDK quotes each key and value before urlencoding the pair list, so every key
    and value is unquoted once more after splitting (harmless for plain values)."""
    if raw is None or not raw.strip():
        return None
    try:
        pairs = parse_qsl(raw, keep_blank_values=True, strict_parsing=True)
    except ValueError as exc:
        raise BadRequest(
            f"invalid metadata filter {raw!r}: expected k=v pairs joined by '&'"
        ) from exc
    result = {unquote(k): unquote(v) for k, v in pairs}
    if "" in result:
        raise BadRequest(f"invalid metadata filter {raw!r}: empty key")
    return result


def parse_states(raw: Iterable[str]) -> set[str]:
    """`state=running,paused` (or repeated `state=`); empty means both."""
    wanted = {s.strip().lower() for item in raw for s in item.split(",") if s.strip()}
    bad = wanted.difference(API_STATES)
    if bad:
        raise BadRequest(
            f"invalid state {', '.join(sorted(bad))!s}: expected running and/or paused"
        )
    return wanted or set(API_STATES)


def sandbox_key(record: SandboxRecord) -> tuple[datetime, str]:
    return (aware(record.started_at), record.sandbox_id)


def paginate(
    records: Sequence[T],
    *,
    order: Order,
    limit: int | None,
    cursor: Cursor | None,
    key: Callable[[T], tuple[datetime, str]] = sandbox_key,  # type: ignore[assignment]
) -> tuple[list[T], str | None]:
    """One page of `records` sorted by `key` — (startedAt, sandboxID) for sandboxes — and
    the token of the next page.

    The token is None on the last page (no empty trailing page: it is only issued when more
    items exist). Because the cursor is a position, not an offset, sandboxes created or
    deleted between pages neither repeat nor shift the remaining ones."""
    desc = order == "desc"
    items = sorted(records, key=key, reverse=desc)
    if cursor is not None:
        mark = (cursor.started_at, cursor.sandbox_id)
        items = [r for r in items if (key(r) < mark if desc else key(r) > mark)]
    if limit is None or len(items) <= limit:
        return items, None
    page = items[:limit]
    at, ident = key(page[-1])
    return page, Cursor(at, ident).encode()
