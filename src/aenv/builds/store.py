"""Builds, their log entries and the step cache, in SQLite ($AENV_HOME/builds.db).

Calls are small and synchronous; the builder runs them in a worker thread where it matters.
Log entries are numbered per build (`seq` from 0), which is what `logsOffset` counts.
Template tags (`template_tags`) point at ready builds; tags.py keeps the catalog in step.
Every assignment of a tag is also recorded (`tag_assignments`), newest last, for E2B's
assignment history; removing a tag removes its history.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import sqlitedb
from ..errors import BadRequest
from .spec import BuildSpec, parse_spec

_SCHEMA = """
CREATE TABLE IF NOT EXISTS builds (
    build_id    TEXT PRIMARY KEY,
    template_id TEXT NOT NULL,
    status      TEXT NOT NULL,
    created     REAL NOT NULL,
    updated     REAL NOT NULL,
    doc         TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS builds_template ON builds (template_id, created);
CREATE TABLE IF NOT EXISTS build_logs (
    build_id TEXT NOT NULL,
    seq      INTEGER NOT NULL,
    ts       REAL NOT NULL,
    level    TEXT NOT NULL,
    message  TEXT NOT NULL,
    step     TEXT,
    PRIMARY KEY (build_id, seq)
);
CREATE TABLE IF NOT EXISTS template_tags (
    template_id TEXT NOT NULL,
    tag         TEXT NOT NULL,
    build_id    TEXT NOT NULL,
    created     REAL NOT NULL,
    PRIMARY KEY (template_id, tag)
);
CREATE TABLE IF NOT EXISTS tag_assignments (
    assignment_id TEXT PRIMARY KEY,
    template_id   TEXT NOT NULL,
    tag           TEXT NOT NULL,
    build_id      TEXT NOT NULL,
    assigned      REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS tag_assignments_tag ON tag_assignments (template_id, tag, assigned);
CREATE TABLE IF NOT EXISTS step_cache (
    key       TEXT PRIMARY KEY,
    layer     TEXT NOT NULL,
    created   REAL NOT NULL,
    last_used REAL NOT NULL
);
"""

LEVELS = ("debug", "info", "warn", "error")


@dataclass
class LogEntry:
    seq: int
    ts: float
    level: str
    message: str
    step: str | None = None


@dataclass(frozen=True)
class TagRow:
    """A tag of a template and the (ready) build it points at."""

    tag: str
    build_id: str
    created: float


@dataclass(frozen=True)
class TagAssignment:
    """One time a tag was pointed at a build (E2B's assignment events): a tag's history,
    kept until the tag is removed."""

    assignment_id: str
    tag: str
    build_id: str
    assigned: float


@dataclass
class BuildReason:
    """Why a build ended in `error`; `step` names the step that failed, if one did."""

    message: str
    step: str | None = None


@dataclass
class BuildRecord:
    build_id: str
    template_id: str
    status: str  # waiting | building | ready | error
    created: float
    updated: float
    name: str = ""  # the requested name without its tag
    names: list[str] = field(default_factory=list)  # `name`, then `name:tag` for every tag
    tags: list[str] = field(default_factory=list)
    cpu_count: int = 0
    memory_mb: int = 0
    # Set when the build starts. Registry credentials are never stored, so a spec read back
    # from the store has none.
    spec: BuildSpec | None = None
    reason: BuildReason | None = None
    finished: float | None = None  # epoch seconds


# The `doc` column holds the fields beyond the indexed ones as JSON, under the keys the
# builds.db files already in use have: keys not known here are ignored.
def _to_doc(b: BuildRecord) -> str:
    doc: dict[str, Any] = {
        "names": b.names,
        "name": b.name,
        "tags": b.tags,
        "cpu_count": b.cpu_count,
        "memory_mb": b.memory_mb,
    }
    if b.spec is not None:
        doc["spec"] = b.spec.to_json()
    if b.reason is not None:
        doc["reason"] = {"message": b.reason.message}
        if b.reason.step:
            doc["reason"]["step"] = b.reason.step
    if b.finished is not None:
        doc["finished"] = b.finished
    return json.dumps(doc)


def _spec_of(raw: Any) -> BuildSpec | None:
    if not isinstance(raw, dict):
        return None
    try:
        return parse_spec(raw)
    except BadRequest:
        # Only kept as a record of the build: one this version no longer accepts must not
        # make the build (or the template listing) unreadable.
        return None


def _from_row(row: tuple[Any, ...]) -> BuildRecord:
    bid, tid, status, created, updated, raw = row
    doc = json.loads(raw)
    reason = doc.get("reason")
    finished = doc.get("finished")
    return BuildRecord(
        build_id=bid,
        template_id=tid,
        status=status,
        created=float(created),
        updated=float(updated),
        name=str(doc.get("name") or ""),
        names=[str(n) for n in doc.get("names") or []],
        tags=[str(t) for t in doc.get("tags") or []],
        cpu_count=int(doc.get("cpu_count") or 0),
        memory_mb=int(doc.get("memory_mb") or 0),
        spec=_spec_of(doc.get("spec")),
        reason=(
            BuildReason(str(reason.get("message")), reason.get("step") or None)
            if isinstance(reason, dict)
            else None
        ),
        finished=float(finished) if finished is not None else None,
    )


class BuildStore:
    def __init__(self, path: Path) -> None:
        self._db = sqlitedb.connect(path, _SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _run(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    # --- builds ---
    def put(self, b: BuildRecord) -> None:
        b.updated = time.time()
        self._run(
            "INSERT INTO builds(build_id, template_id, status, created, updated, doc) "
            "VALUES(?,?,?,?,?,?) ON CONFLICT(build_id) DO UPDATE SET "
            "template_id=excluded.template_id, status=excluded.status, "
            "updated=excluded.updated, doc=excluded.doc",
            (b.build_id, b.template_id, b.status, b.created, b.updated, _to_doc(b)),
        )

    def get(self, build_id: str) -> BuildRecord | None:
        rows = self._run(
            "SELECT build_id, template_id, status, created, updated, doc FROM builds "
            "WHERE build_id=?",
            (build_id,),
        )
        return _from_row(rows[0]) if rows else None

    def for_template(self, template_id: str) -> list[BuildRecord]:
        """Newest first."""
        rows = self._run(
            "SELECT build_id, template_id, status, created, updated, doc FROM builds "
            "WHERE template_id=? ORDER BY created DESC",
            (template_id,),
        )
        return [_from_row(r) for r in rows]

    def all(self) -> list[BuildRecord]:
        rows = self._run(
            "SELECT build_id, template_id, status, created, updated, doc FROM builds "
            "ORDER BY created DESC"
        )
        return [_from_row(r) for r in rows]

    def unfinished(self) -> list[BuildRecord]:
        rows = self._run(
            "SELECT build_id, template_id, status, created, updated, doc FROM builds "
            "WHERE status IN ('waiting', 'building')"
        )
        return [_from_row(r) for r in rows]

    def delete_template(self, template_id: str) -> None:
        with self._lock:
            ids = [
                r[0]
                for r in self._db.execute(
                    "SELECT build_id FROM builds WHERE template_id=?", (template_id,)
                )
            ]
            self._db.executemany("DELETE FROM build_logs WHERE build_id=?", [(i,) for i in ids])
            self._db.execute("DELETE FROM builds WHERE template_id=?", (template_id,))
            self._db.execute("DELETE FROM template_tags WHERE template_id=?", (template_id,))
            self._db.execute("DELETE FROM tag_assignments WHERE template_id=?", (template_id,))

    # --- tags ---
    def tags(self, template_id: str) -> list[TagRow]:
        """Oldest assignment first."""
        rows = self._run(
            "SELECT tag, build_id, created FROM template_tags WHERE template_id=? "
            "ORDER BY created, tag",
            (template_id,),
        )
        return [TagRow(str(t), str(b), float(c)) for t, b, c in rows]

    def set_tags(self, template_id: str, build_id: str, tags: Iterable[str]) -> None:
        """Points `tags` at `build_id` (a tag moved keeps no trace of its earlier build)."""
        now = time.time()
        tags = list(tags)
        with self._lock:
            self._db.executemany(
                "INSERT INTO template_tags(template_id, tag, build_id, created) VALUES(?,?,?,?) "
                "ON CONFLICT(template_id, tag) DO UPDATE SET build_id=excluded.build_id, "
                "created=excluded.created",
                [(template_id, t, build_id, now) for t in tags],
            )
            self._db.executemany(
                "INSERT INTO tag_assignments(assignment_id, template_id, tag, build_id, assigned)"
                " VALUES(?,?,?,?,?)",
                [(str(uuid.uuid4()), template_id, t, build_id, now) for t in tags],
            )

    def remove_tags(self, template_id: str, tags: Iterable[str]) -> None:
        pairs = [(template_id, t) for t in tags]
        with self._lock:
            self._db.executemany("DELETE FROM template_tags WHERE template_id=? AND tag=?", pairs)
            self._db.executemany("DELETE FROM tag_assignments WHERE template_id=? AND tag=?", pairs)

    def assignments(self, template_id: str) -> list[TagAssignment]:
        """Every recorded assignment of the template's tags, newest first."""
        rows = self._run(
            "SELECT assignment_id, tag, build_id, assigned FROM tag_assignments "
            "WHERE template_id=? ORDER BY assigned DESC, assignment_id",
            (template_id,),
        )
        return [TagAssignment(str(i), str(t), str(b), float(a)) for i, t, b, a in rows]

    # --- logs ---
    def add_logs(self, build_id: str, entries: list[LogEntry]) -> None:
        if not entries:
            return
        with self._lock:
            self._db.executemany(
                "INSERT OR REPLACE INTO build_logs(build_id, seq, ts, level, message, step) "
                "VALUES(?,?,?,?,?,?)",
                [(build_id, e.seq, e.ts, e.level, e.message, e.step) for e in entries],
            )

    def logs(self, build_id: str) -> list[LogEntry]:
        rows = self._run(
            "SELECT seq, ts, level, message, step FROM build_logs WHERE build_id=? ORDER BY seq",
            (build_id,),
        )
        return [LogEntry(int(s), float(t), str(lv), str(m), st) for s, t, lv, m, st in rows]

    # --- step cache ---
    def cached(self, key: str) -> str | None:
        rows = self._run("SELECT layer FROM step_cache WHERE key=?", (key,))
        if not rows:
            return None
        self._run("UPDATE step_cache SET last_used=? WHERE key=?", (time.time(), key))
        return str(rows[0][0])

    def cache(self, key: str, layer: str) -> None:
        now = time.time()
        self._run(
            "INSERT INTO step_cache(key, layer, created, last_used) VALUES(?,?,?,?) "
            "ON CONFLICT(key) DO UPDATE SET layer=excluded.layer, last_used=excluded.last_used",
            (key, layer, now, now),
        )

    def uncache(self, key: str) -> None:
        self._run("DELETE FROM step_cache WHERE key=?", (key,))
