"""Listings merged across nodes. Every node pages by position — the (time, id) of the last
item, after which its next page starts — so the same cursor is meaningful on all of them:
the gateway asks each node for a page after the client's cursor, merges the pages in
order and cuts at `limit`; its own cursor is the position of the last item it returned.
Bulk operations' answers are joined here too."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from ..paging import Cursor
from .records import NodeRecord

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _when(value: object) -> datetime:
    if not isinstance(value, str):
        return _EPOCH
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return _EPOCH
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def merge_pages(
    pages: list[tuple[list[dict[str, Any]], bool]],
    *,
    time_field: str,
    id_field: str,
    desc: bool,
    limit: int | None,
) -> tuple[list[dict[str, Any]], str | None]:
    """`pages`: each node's items and whether it has more. Returns one page (no item
    twice: a template every node learned is listed once) and its next-page token."""
    seen: dict[str, dict[str, Any]] = {}
    for items, _more in pages:
        for item in items:
            seen.setdefault(str(item.get(id_field)), item)

    def key(item: dict[str, Any]) -> tuple[datetime, str]:
        return _when(item.get(time_field)), str(item.get(id_field))

    merged = sorted(seen.values(), key=key, reverse=desc)
    more = any(m for _, m in pages)
    if limit is None or (len(merged) <= limit and not more):
        return merged, None
    page = merged[:limit]
    if not page:
        return page, None
    at, ident = key(page[-1])
    return page, Cursor(at, ident).encode()


def node_view(n: NodeRecord) -> dict[str, Any]:
    """E2B's `Node` fields the gateway knows from heartbeats, and ours."""
    status = "unhealthy" if not n.healthy else n.status
    return {
        "nodeID": n.node_id,
        "id": n.node_id,
        "status": status,
        "url": n.url,
        "version": n.version,
        "sandboxCount": n.sandboxes,
        "runningSandboxCount": n.running,
        "heartbeatAt": datetime.fromtimestamp(n.heartbeat_at, UTC).isoformat(),
        "cpuCount": n.cpu_count,
        "memoryMB": n.memory_total_mb,
        "allocatedCPU": n.allocated_cpu,
        "allocatedMemoryMB": n.allocated_memory_mb,
        "freeMemoryMB": n.free_memory_mb,
        "templates": n.templates,
    }


class BulkJoin:
    """The answers of every node to a bulk operation (api/routes/bulk.py), joined: the ids
    acted on, the failures, and the nodes that could not be reached (their sandboxes were
    left as they were; the others' acts stand)."""

    def __init__(self) -> None:
        self.done: list[str] = []
        self.failed: list[Any] = []
        self.unreachable: list[str] = []

    def add(self, answer: dict[str, Any]) -> list[str]:
        """One node's answer; the ids it acted on."""
        ids = [i for i in answer.get("sandboxIDs") or [] if isinstance(i, str)]
        self.done.extend(ids)
        self.failed.extend(answer.get("failed") or [])
        return ids

    def doc(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sandboxIDs": self.done, "failed": self.failed}
        if self.unreachable:
            out["unreachableNodes"] = self.unreachable
        return out
