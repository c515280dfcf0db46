"""envd's own log: a bounded in-memory journal of what it did (its log lines, every process
it started and how that ended), read by the node through ``GET /logs?after=SEQ``.

The node pulls new entries every few seconds and keeps them for the sandbox's life, so the
journal only has to bridge the gap between two pulls; it lives in envd's memory, so it is
checkpointed and restored with the sandbox (pause, snapshot, fork) like everything else."""

from __future__ import annotations

import collections
import time
from typing import Any

# Entries kept between two pulls of the node; older ones are dropped first.
MAX_ENTRIES = 2000
# A field value longer than this is cut (a command line can be long).
MAX_FIELD = 512

_entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_ENTRIES)
_seq = 0


def record(level: str, message: str, **fields: object) -> None:
    """Adds one entry; `level` is E2B's (debug, info, warn, error)."""
    global _seq
    _seq += 1
    _entries.append(
        {
            "seq": _seq,
            "ts": time.time(),
            "level": level,
            "message": message,
            "fields": {k: str(v)[:MAX_FIELD] for k, v in fields.items() if v is not None},
        }
    )


def since(after: int, limit: int = MAX_ENTRIES) -> dict[str, Any]:
    """Entries with a sequence number above `after` (oldest first), and the last number."""
    out = [e for e in _entries if e["seq"] > after][:limit]
    return {"seq": _seq, "entries": out}
