"""Reference counts and the bounded LRU eviction of the layer store.

Whoever uses a layer holds a reference to it: a template, a snapshot, a sandbox (holders are
free-form strings, by convention `kind:id`, e.g. `sandbox:ib3x…`, `template:base`). The
references live in SQLite (`layers/refs.db`), so they survive restarts and are shared by
every process using the same store.

`gc(capacity, high, low)` runs when usage (the sum of the layers' file bytes) exceeds
`high * capacity` and removes least recently used layers that **nobody references** until
usage is at most `low * capacity`. A referenced layer is never removed, even if the bound
cannot be met. Recency is `LayerStore.touch` (`last_used` in meta.json; a layer never touched
counts from its creation).

Race rules: `ref` and the eviction decision serialize on the database's write lock, and an
evicted layer leaves the store (one rename) inside that critical section. So: take the
reference first, then check `LayerStore.has` — if the layer is there it stays there. A
reference may be taken for a layer that is not in the store yet (a pull pins its layers
before downloading them).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from .. import sqlitedb
from ..config import ImageSettings
from ..errors import NotFound
from ..fsutil import rmtree
from .layers import LayerInfo, LayerStore, parse_digest

_SCHEMA = """
CREATE TABLE IF NOT EXISTS layer_refs (
    digest  TEXT NOT NULL,
    holder  TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (digest, holder)
);
CREATE INDEX IF NOT EXISTS layer_refs_holder ON layer_refs (holder);
"""


@dataclass(frozen=True)
class GcResult:
    evicted: list[str] = field(default_factory=list)
    freed: int = 0  # bytes
    usage: int = 0  # bytes after the run
    capacity: int = 0


def holder(kind: str, ident: str) -> str:
    return f"{kind}:{ident}"


def _last_used(info: LayerInfo) -> float:
    if info.last_used is not None:
        return float(info.last_used)
    try:
        return datetime.fromisoformat(info.created).timestamp()
    except ValueError:
        return 0.0


class LayerCache:
    """References to and eviction of the layers of one `LayerStore`."""

    def __init__(self, store: LayerStore, db_path: Path | None = None) -> None:
        self.store = store
        self.db_path = db_path or store.root / "refs.db"
        self._ready = False
        # One connection per thread, kept: opening one costs more than most calls here.
        self._local = threading.local()

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            # A host crash may lose the last references (commits are not fsynced: one per
            # reference cost ms on the btrfs pool); the node takes them again from its
            # catalog at start-up (templates' and sandboxes' layers).
            conn = sqlitedb.connect(self.db_path, None if self._ready else _SCHEMA, timeout=60)
            self._ready = True
            self._local.conn = conn
        try:
            yield conn
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    # --- references ---
    def ref(self, digest: str, holder: str) -> None:
        self.ref_many([digest], holder)

    def ref_many(self, digests: Iterable[str], holder: str) -> None:
        rows = [(d, holder, time.time()) for d in digests]
        for d, _, _ in rows:
            parse_digest(d)
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            db.executemany(
                "INSERT OR IGNORE INTO layer_refs (digest, holder, created) VALUES (?, ?, ?)", rows
            )
            db.execute("COMMIT")

    def unref(self, digest: str, holder: str) -> bool:
        with self._db() as db:
            cur = db.execute(
                "DELETE FROM layer_refs WHERE digest = ? AND holder = ?", (digest, holder)
            )
            return cur.rowcount > 0

    def release(self, holder: str) -> list[str]:
        """Drops every reference `holder` has; returns the digests it held."""
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            rows = db.execute(
                "SELECT digest FROM layer_refs WHERE holder = ?", (holder,)
            ).fetchall()
            db.execute("DELETE FROM layer_refs WHERE holder = ?", (holder,))
            db.execute("COMMIT")
        return [r[0] for r in rows]

    def holders(self, digest: str) -> list[str]:
        with self._db() as db:
            rows = db.execute(
                "SELECT holder FROM layer_refs WHERE digest = ? ORDER BY holder", (digest,)
            ).fetchall()
        return [r[0] for r in rows]

    def held_by(self, holder: str) -> list[str]:
        with self._db() as db:
            rows = db.execute(
                "SELECT digest FROM layer_refs WHERE holder = ? ORDER BY digest", (holder,)
            ).fetchall()
        return [r[0] for r in rows]

    def all_holders(self) -> set[str]:
        with self._db() as db:
            return {r[0] for r in db.execute("SELECT DISTINCT holder FROM layer_refs")}

    def referenced(self) -> set[str]:
        with self._db() as db:
            return {r[0] for r in db.execute("SELECT DISTINCT digest FROM layer_refs")}

    # --- use and size ---
    def touch(self, digest: str) -> None:
        """Marks a layer as used now (it moves to the back of the eviction queue)."""
        with contextlib.suppress(NotFound):
            self.store.touch(digest)

    def usage(self) -> int:
        return sum(info.size for info in self.store.list())

    # --- eviction ---
    def gc(self, capacity: int, high: float = 0.9, low: float = 0.7) -> GcResult:
        """Evicts least recently used unreferenced layers when usage > high*capacity, until
        usage <= low*capacity. `capacity` in bytes; 0 or less means unbounded."""
        layers = self.store.list()
        usage = sum(info.size for info in layers)
        if capacity <= 0 or usage <= high * capacity:
            return GcResult([], 0, usage, capacity)
        target = low * capacity
        evicted: list[str] = []
        trash: list[Path] = []
        freed = 0
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                refs = {r[0] for r in db.execute("SELECT DISTINCT digest FROM layer_refs")}
                victims = sorted(
                    (info for info in layers if info.digest not in refs), key=_last_used
                )
                for info in victims:
                    if usage <= target:
                        break
                    moved = self._detach(info.digest)
                    if moved is None:
                        continue
                    trash.append(moved)
                    evicted.append(info.digest)
                    usage -= info.size
                    freed += info.size
            finally:
                db.execute("COMMIT")
        for path in trash:
            rmtree(path)
        return GcResult(evicted, freed, usage, capacity)

    def enforce(self, settings: ImageSettings) -> GcResult:
        """`gc` with the configured bound (`layer_cache_gb`, `layer_cache_high/low`)."""
        return self.gc(
            settings.layer_cache_bytes, settings.layer_cache_high, settings.layer_cache_low
        )

    def _detach(self, digest: str) -> Path | None:
        """Renames a layer out of the store (atomic); its files are deleted later."""
        self.store.tmp.mkdir(parents=True, exist_ok=True)
        dest = self.store.tmp / f"evict-{uuid.uuid4().hex}"
        try:
            os.rename(self.store.layer_dir(digest), dest)
        except FileNotFoundError:
            return None
        return dest
