"""Where the next page of a listing starts: an opaque token that a node's API and the
gateway (which merges the nodes' pages) both read and write."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import UTC, datetime

from .errors import BadRequest


@dataclass(frozen=True)
class Cursor:
    """Position after the last item of a page: the sort key of that item (for sandboxes
    (startedAt, sandboxID), for snapshots (createdAt, snapshotID))."""

    started_at: datetime
    sandbox_id: str

    def encode(self) -> str:
        raw = json.dumps([self.started_at.isoformat(), self.sandbox_id], separators=(",", ":"))
        return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, token: str) -> Cursor:
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            started, sandbox_id = json.loads(raw)
            if not isinstance(started, str) or not isinstance(sandbox_id, str):
                raise ValueError("wrong types")
            when = datetime.fromisoformat(started)
        except (binascii.Error, ValueError, TypeError, UnicodeDecodeError) as exc:
            raise BadRequest("invalid nextToken") from exc
        return cls(aware(when), sandbox_id)


def aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
