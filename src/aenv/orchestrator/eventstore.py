"""Lifecycle events, webhooks and their outbox in one SQLite file under $AENV_HOME
(`events.db`). Synchronous: `Events` runs every call on one worker thread of its own, so
calls happen in the order they were made (an event's place is its order of recording) and
the event loop never waits on disk.

An event is written in the same transaction as one outbox row per webhook that wants it:
a webhook's pending events survive a restart, and none is written without its deliveries.
Each webhook's outbox is bounded; past the bound its oldest rows are dropped, counted and
listed in its delivery history."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .. import sqlitedb
from .eventrecords import (
    DELIVERED,
    DROPPED,
    FAILED,
    Delivery,
    Due,
    LifecycleEvent,
    Webhook,
    WebhookStats,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    type TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    at REAL NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_sandbox ON events(sandbox_id, at);
CREATE INDEX IF NOT EXISTS events_at ON events(at);
CREATE TABLE IF NOT EXISTS webhooks (id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS outbox (
    webhook_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    sandbox_id TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_at REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (webhook_id, seq)
);
CREATE INDEX IF NOT EXISTS outbox_sandbox ON outbox(webhook_id, sandbox_id, seq);
CREATE TABLE IF NOT EXISTS deliveries (
    id TEXT PRIMARY KEY,
    webhook_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    event_type TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    at REAL NOT NULL,
    attempt INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    status_code INTEGER,
    duration_ms INTEGER NOT NULL,
    error TEXT
);
CREATE INDEX IF NOT EXISTS deliveries_webhook ON deliveries(webhook_id, at);
CREATE TABLE IF NOT EXISTS counters (
    webhook_id TEXT NOT NULL,
    outcome TEXT NOT NULL,
    n INTEGER NOT NULL,
    PRIMARY KEY (webhook_id, outcome)
);
"""


def _ts(t: datetime) -> float:
    return t.timestamp()


def _dt(x: float | None) -> datetime | None:
    return None if x is None else datetime.fromtimestamp(x, UTC)


class EventStore:
    def __init__(self, path: Path, backlog: int) -> None:
        self._db = sqlitedb.connect(path, _SCHEMA)
        self.backlog = backlog
        self._hooks = {
            w.id: w for w in (Webhook.from_doc(d) for (d,) in self._q("SELECT doc FROM webhooks"))
        }

    def close(self) -> None:
        self._db.close()

    def _q(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self._db.execute(sql, tuple(args)).fetchall()

    # ---------------------------------------------------------------- events
    def append(self, e: LifecycleEvent, now: float) -> tuple[list[str], int]:
        """Records `e` with its outbox rows; returns the webhooks that have it pending and
        how many older events the backlog bound dropped meanwhile."""
        wanting = [w.id for w in self._hooks.values() if w.wants(e.type)]
        dropped = 0
        with self._db:
            cur = self._db.execute(
                "INSERT INTO events(id, type, sandbox_id, at, body) VALUES(?,?,?,?,?)",
                (e.id, e.type, e.sandbox_id, _ts(e.timestamp), e.body().decode()),
            )
            seq = cur.lastrowid
            for hook in wanting:
                self._db.execute(
                    "INSERT INTO outbox(webhook_id, seq, sandbox_id) VALUES(?,?,?)",
                    (hook, seq, e.sandbox_id),
                )
                dropped += self._bound(hook, now)
        return wanting, dropped

    def _bound(self, hook: str, now: float) -> int:
        ((n,),) = self._q("SELECT COUNT(*) FROM outbox WHERE webhook_id=?", (hook,))
        over = n - self.backlog
        if over <= 0:
            return 0
        rows = self._q(
            "SELECT o.seq, o.attempts, e.id, e.type, e.sandbox_id FROM outbox o "
            "JOIN events e ON e.seq=o.seq WHERE o.webhook_id=? ORDER BY o.seq LIMIT ?",
            (hook, over),
        )
        for seq, attempts, eid, etype, sid in rows:
            self._db.execute("DELETE FROM outbox WHERE webhook_id=? AND seq=?", (hook, seq))
            self._history(
                Delivery(
                    str(uuid.uuid4()),
                    hook,
                    eid,
                    etype,
                    sid,
                    _dt(now) or datetime.now(UTC),
                    attempts,
                    DROPPED,
                    error=f"backlog over {self.backlog} events: oldest dropped",
                )
            )
        return len(rows)

    def query(
        self,
        *,
        sandbox_id: str | None,
        types: Sequence[str],
        offset: int,
        limit: int,
        ascending: bool,
        since: datetime,
    ) -> list[str]:
        """Event bodies (JSON text), oldest or newest first, from `since` on."""
        where, args = ["at >= ?"], [_ts(since)]
        if sandbox_id is not None:
            where.append("sandbox_id = ?")
            args.append(sandbox_id)  # type: ignore[arg-type]
        if types:
            where.append(f"type IN ({','.join('?' * len(types))})")
            args.extend(types)  # type: ignore[arg-type]
        order = "ASC" if ascending else "DESC"
        rows = self._q(
            f"SELECT body FROM events WHERE {' AND '.join(where)} "
            f"ORDER BY at {order}, seq {order} LIMIT ? OFFSET ?",
            [*args, limit, offset],
        )
        return [b for (b,) in rows]

    def prune(self, events_before: datetime, deliveries_before: float) -> tuple[int, int]:
        """Forgets events older than the retention (an outbox row still waiting for one is
        dropped, counted) and delivery history older than it. Returns the events removed
        and the deliveries dropped."""
        cut = _ts(events_before)
        with self._db:
            stale = self._q(
                "SELECT o.webhook_id, o.seq, o.attempts, e.id, e.type, e.sandbox_id "
                "FROM outbox o JOIN events e ON e.seq=o.seq WHERE e.at < ?",
                (cut,),
            )
            for hook, seq, attempts, eid, etype, sid in stale:
                self._db.execute("DELETE FROM outbox WHERE webhook_id=? AND seq=?", (hook, seq))
                self._history(
                    Delivery(
                        str(uuid.uuid4()),
                        hook,
                        eid,
                        etype,
                        sid,
                        datetime.now(UTC),
                        attempts,
                        DROPPED,
                        error="undelivered past the events' retention",
                    )
                )
            n = self._db.execute("DELETE FROM events WHERE at < ?", (cut,)).rowcount
            self._db.execute("DELETE FROM deliveries WHERE at < ?", (deliveries_before,))
        return n, len(stale)

    # ---------------------------------------------------------------- webhooks
    def webhooks(self) -> list[Webhook]:
        return sorted(self._hooks.values(), key=lambda w: (w.created_at, w.id))

    def webhook(self, webhook_id: str) -> Webhook | None:
        return self._hooks.get(webhook_id)

    def put_webhook(self, w: Webhook) -> None:
        with self._db:
            self._db.execute(
                "INSERT INTO webhooks(id, doc) VALUES(?,?) "
                "ON CONFLICT(id) DO UPDATE SET doc=excluded.doc",
                (w.id, w.to_doc()),
            )
        self._hooks[w.id] = w

    def delete_webhook(self, webhook_id: str) -> bool:
        with self._db:
            n = self._db.execute("DELETE FROM webhooks WHERE id=?", (webhook_id,)).rowcount
            for table in ("outbox", "deliveries", "counters"):
                self._db.execute(f"DELETE FROM {table} WHERE webhook_id=?", (webhook_id,))
        self._hooks.pop(webhook_id, None)
        return n > 0

    # ---------------------------------------------------------------- the outbox
    def due(self, webhook_id: str, now: float, limit: int) -> list[Due]:
        """The webhook's events it may be sent now: the oldest pending of each sandbox
        (a later one waits for it: each sandbox's events arrive in order), if its retry
        time has come, oldest first."""
        rows = self._q(
            "SELECT o.seq, o.sandbox_id, o.attempts, e.body FROM outbox o "
            "JOIN events e ON e.seq=o.seq "
            "WHERE o.webhook_id=? AND o.next_at<=? AND NOT EXISTS ("
            "  SELECT 1 FROM outbox p WHERE p.webhook_id=o.webhook_id "
            "  AND p.sandbox_id=o.sandbox_id AND p.seq<o.seq) "
            "ORDER BY o.seq LIMIT ?",
            (webhook_id, now, limit),
        )
        return [Due(seq, sid, att, _event(body), body.encode()) for seq, sid, att, body in rows]

    def next_retry(self, webhook_id: str) -> float | None:
        ((at,),) = self._q("SELECT MIN(next_at) FROM outbox WHERE webhook_id=?", (webhook_id,))
        return None if at is None else float(at)

    def backlog_of(self, webhook_id: str | None = None) -> int:
        if webhook_id is None:
            ((n,),) = self._q("SELECT COUNT(*) FROM outbox")
        else:
            ((n,),) = self._q("SELECT COUNT(*) FROM outbox WHERE webhook_id=?", (webhook_id,))
        return int(n)

    def settle(self, d: Delivery, seq: int, retry_at: float | None) -> None:
        """Records an attempt: delivered (out of the outbox) or failed (`retry_at`)."""
        with self._db:
            if d.outcome == DELIVERED:
                self._db.execute(
                    "DELETE FROM outbox WHERE webhook_id=? AND seq=?", (d.webhook_id, seq)
                )
            else:
                self._db.execute(
                    "UPDATE outbox SET attempts=?, next_at=? WHERE webhook_id=? AND seq=?",
                    (d.attempt, retry_at or 0.0, d.webhook_id, seq),
                )
            self._history(d)

    def _history(self, d: Delivery) -> None:
        self._db.execute(
            "INSERT INTO deliveries(id, webhook_id, event_id, event_type, sandbox_id, at, "
            "attempt, outcome, status_code, duration_ms, error) VALUES(?,?,?,?,?,?,?,?,?,?,?)",
            (
                d.id,
                d.webhook_id,
                d.event_id,
                d.event_type,
                d.sandbox_id,
                _ts(d.at),
                d.attempt,
                d.outcome,
                d.status_code,
                d.duration_ms,
                d.error,
            ),
        )
        self._db.execute(
            "INSERT INTO counters(webhook_id, outcome, n) VALUES(?,?,1) "
            "ON CONFLICT(webhook_id, outcome) DO UPDATE SET n=n+1",
            (d.webhook_id, d.outcome),
        )

    def deliveries(self, webhook_id: str, offset: int, limit: int) -> list[Delivery]:
        rows = self._q(
            "SELECT id, webhook_id, event_id, event_type, sandbox_id, at, attempt, outcome, "
            "status_code, duration_ms, error FROM deliveries WHERE webhook_id=? "
            "ORDER BY at DESC, rowid DESC LIMIT ? OFFSET ?",
            (webhook_id, limit, offset),
        )
        return [
            Delivery(i, w, e, t, s, datetime.fromtimestamp(at, UTC), a, o, c, ms, err)
            for i, w, e, t, s, at, a, o, c, ms, err in rows
        ]

    def stats(self, webhook_id: str) -> WebhookStats:
        counts = dict(self._q("SELECT outcome, n FROM counters WHERE webhook_id=?", (webhook_id,)))
        last: dict[str, float | None] = {}
        for outcome in (DELIVERED, FAILED):
            ((at,),) = self._q(
                "SELECT MAX(at) FROM deliveries WHERE webhook_id=? AND outcome=?",
                (webhook_id, outcome),
            )
            last[outcome] = at
        err = self._q(
            "SELECT error FROM deliveries WHERE webhook_id=? AND outcome=? "
            "ORDER BY at DESC, rowid DESC LIMIT 1",
            (webhook_id, FAILED),
        )
        return WebhookStats(
            delivered=int(counts.get(DELIVERED, 0)),
            failed=int(counts.get(FAILED, 0)),
            dropped=int(counts.get(DROPPED, 0)),
            backlog=self.backlog_of(webhook_id),
            last_delivered_at=_dt(last[DELIVERED]),
            last_failed_at=_dt(last[FAILED]),
            last_error=err[0][0] if err else None,
        )


def _event(body: str) -> LifecycleEvent:
    return LifecycleEvent.from_wire(json.loads(body))
