"""Opening the node's SQLite databases (the catalog, the build store, the layer references)
one way: readable by root only, write-ahead logged, commits not fsynced (a host crash may
lose the last ones; each store rebuilds or retakes what it needs at start-up), shared by the
threads of the process."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from .fsutil import private_sqlite

# Switching a new database to WAL wants it to itself and does not wait for a busy one: two
# stores of one file opening it first at once made one fail with "database is locked". One
# lock for the process; a moment's retry for other processes.
_PREPARE = threading.Lock()
_PREPARE_TRIES = 50


def connect(
    path: Path, schema: str | None = None, *, foreign_keys: bool = False, timeout: float = 5.0
) -> sqlite3.Connection:
    """A connection to `path`. With `schema` (the first connection of a store), the file is
    made private and switched to WAL and the schema applied; later connections pass none."""
    if schema is not None:
        private_sqlite(path)
    conn = sqlite3.connect(
        str(path), timeout=timeout, isolation_level=None, check_same_thread=False
    )
    conn.execute("PRAGMA synchronous=NORMAL")
    if foreign_keys:
        conn.execute("PRAGMA foreign_keys=ON")
    if schema is not None:
        _prepare(conn, schema)
    return conn


def _prepare(conn: sqlite3.Connection, schema: str) -> None:
    with _PREPARE:
        for attempt in range(_PREPARE_TRIES):
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.executescript(schema)
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or attempt == _PREPARE_TRIES - 1:
                    raise
                time.sleep(0.1)
