"""Per-sandbox logs, kept on the node for the sandbox's life (bounded): the node's own
lifecycle events for the sandbox (created, paused, resumed, snapshot, forked...) and envd's
journal (`envd/journal.py`: envd's log lines, each process started through it and its
exit), read from envd when a logs request is answered, never on a timer: an idle sandbox
gets no request from the node. envd keeps a bounded journal meanwhile; what a sandbox
logged after the last read and before it was killed is not kept.

What processes print is not kept: it can be large and secret, and the SDK already streams
it to whoever started the process."""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import httpx

from ..domain import SandboxRecord, SandboxState
from ..errors import AenvError
from .context import NodeContext
from .table import SandboxTable

log = logging.getLogger("aenv.orchestrator")

# Entries kept per sandbox; the oldest go first.
MAX_ENTRIES = 5000
LEVELS = ("debug", "info", "warn", "error")


@dataclass(frozen=True)
class LogEntry:
    at: datetime
    level: str  # one of LEVELS
    message: str
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def line(self) -> str:
        """The entry as one line (E2B's v1 `logs[].line`)."""
        extra = " ".join(f"{k}={v}" for k, v in self.fields.items())
        return f"{self.message} {extra}" if extra else self.message


class Journal(Protocol):
    async def logs(self, after: int) -> dict[str, Any]: ...


class JournalSource(Protocol):
    """Where a sandbox's envd journal is read: the envd at an address, with its token."""

    def at(self, host: str, token: str | None = None) -> Journal: ...


class SandboxLogs:
    def __init__(
        self,
        ctx: NodeContext,
        table: SandboxTable,
        envd: JournalSource,
        size: int = MAX_ENTRIES,
    ) -> None:
        self.ctx = ctx
        self.table = table
        self.envd = envd
        self.size = size
        self._entries: dict[str, collections.deque[LogEntry]] = {}
        # The last envd journal entry taken, per sandbox.
        self._cursor: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def _ring(self, sandbox_id: str) -> collections.deque[LogEntry]:
        ring = self._entries.get(sandbox_id)
        if ring is None:
            ring = self._entries[sandbox_id] = collections.deque(maxlen=self.size)
        return ring

    def note(self, sandbox_id: str, message: str, level: str = "info", **fields: object) -> None:
        """A node event about the sandbox."""
        self._ring(sandbox_id).append(
            LogEntry(
                datetime.now(UTC),
                level,
                message,
                {"source": "node", **{k: str(v) for k, v in fields.items() if v is not None}},
            )
        )

    def prune(self) -> None:
        """Forgets sandboxes the node no longer has."""
        live = {r.sandbox_id for r in self.table.all()}
        for gone in self._entries.keys() - live:
            self._entries.pop(gone, None)
            self._cursor.pop(gone, None)
            self._locks.pop(gone, None)

    async def read(self, sandbox_id: str) -> list[LogEntry]:
        """The sandbox's entries (envd's journal read first), oldest first."""
        r = self.table.get(sandbox_id)
        await self.ctx.wake(sandbox_id)  # envd answers only awake
        await self.pull(r)
        return self.entries(r)

    async def pull(self, r: SandboxRecord) -> None:
        """Takes envd's new journal entries (a running sandbox only: a frozen envd cannot
        answer, and a paused sandbox's were taken up to its last pull)."""
        if r.state is not SandboxState.RUNNING or r.address is None:
            return
        # Under the sandbox's own lock, and not while an operation holds it: a connection
        # opened while a snapshot checkpoints the sandbox would wedge the restored copy's
        # network (runsc 20240729), so the journal waits for the next round.
        op = self.table.lock(r.sandbox_id)
        if op.locked():
            return
        lock = self._locks.setdefault(r.sandbox_id, asyncio.Lock())
        async with lock, op:
            if r.state is not SandboxState.RUNNING or r.address is None:
                return
            after = self._cursor.get(r.sandbox_id, 0)
            body = await self._read(r, after)
            if body is not None and body[0] < after:
                # envd counts from 0 again (a fresh boot on the kept files): all is new.
                body = await self._read(r, 0)
            if body is None:
                return
            seq, entries = body
            ring = self._ring(r.sandbox_id)
            for e in entries:
                entry = _entry(e)
                if entry is not None:
                    ring.append(entry)
            self._cursor[r.sandbox_id] = seq

    async def _read(self, r: SandboxRecord, after: int) -> tuple[int, list[Any]] | None:
        assert r.address is not None
        try:
            body = await self.envd.at(r.address, r.envd_access_token).logs(after)
        except (AenvError, httpx.HTTPError, ValueError) as e:
            log.debug("envd journal of %s not read: %s", r.sandbox_id, e)
            return None
        entries, seq = body.get("entries"), body.get("seq")
        if not isinstance(entries, list) or not isinstance(seq, int):
            return None
        return seq, entries

    def entries(self, r: SandboxRecord) -> list[LogEntry]:
        """Every entry kept, oldest first. Entries from before the sandbox was handed out
        are its boot snapshot's, its fork parent's (restored with envd's memory) or the
        warm pool's, not its own."""
        since = r.started_at - timedelta(seconds=1)
        return sorted(
            (e for e in self._entries.get(r.sandbox_id, ()) if e.at >= since),
            key=lambda e: e.at,
        )


def _entry(raw: object) -> LogEntry | None:
    if not isinstance(raw, dict):
        return None
    ts, level, message = raw.get("ts"), raw.get("level"), raw.get("message")
    fields = raw.get("fields") or {}
    if not isinstance(ts, int | float) or not isinstance(message, str):
        return None
    if level not in LEVELS:
        level = "info"
    return LogEntry(
        datetime.fromtimestamp(ts, UTC),
        str(level),
        message,
        {str(k): str(v) for k, v in fields.items()} if isinstance(fields, dict) else {},
    )
