"""The node's catalog: sandboxes and templates in SQLite under $AENV_HOME.

Records are stored as JSON documents next to the few columns we query on. Every call is
small; the async wrappers run them in a worker thread so the event loop never waits on disk.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .. import sqlitedb
from ..domain import SandboxRecord, TemplateRecord, record_from_json, record_to_json

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS templates (
    id TEXT PRIMARY KEY,
    doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS template_names (
    name TEXT PRIMARY KEY,
    template_id TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE
);
"""


class Catalog:
    def __init__(self, path: Path) -> None:
        # Private: it holds envd and traffic tokens.
        self._db = sqlitedb.connect(path, _SCHEMA, foreign_keys=True)
        self._lock = threading.Lock()

    def close(self) -> None:
        # Under the lock: closing the connection while a thread runs a query on it crashes
        # the interpreter (seen: a node dropped mid-operation, as the crash tests do).
        with self._lock:
            self._db.close()

    def _run(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    # --- sandboxes (sync; small and called from threads or at startup) ---
    def put_sandbox(self, r: SandboxRecord) -> None:
        self._run(
            "INSERT INTO sandboxes(id, state, doc) VALUES(?,?,?) "
            "ON CONFLICT(id) DO UPDATE SET state=excluded.state, doc=excluded.doc",
            (r.sandbox_id, r.state.value, record_to_json(r)),
        )

    def delete_sandbox(self, sandbox_id: str) -> None:
        self._run("DELETE FROM sandboxes WHERE id=?", (sandbox_id,))

    def sandboxes(self) -> list[SandboxRecord]:
        return [record_from_json(doc) for (doc,) in self._run("SELECT doc FROM sandboxes")]

    # --- templates: documents with an id and any number of unique names ---
    def put_template(self, t: TemplateRecord, *, exact_names: bool = False) -> None:
        """Adds or replaces a template; its names are added to the ones it has (a name
        another template had moves to this one), or with `exact_names` replace them."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute(
                    "INSERT INTO templates(id, doc) VALUES(?,?) "
                    "ON CONFLICT(id) DO UPDATE SET doc=excluded.doc",
                    (t.template_id, json.dumps(t.to_doc())),
                )
                for name in t.names:
                    self._db.execute(
                        "INSERT INTO template_names(name, template_id) VALUES(?,?) "
                        "ON CONFLICT(name) DO UPDATE SET template_id=excluded.template_id",
                        (name, t.template_id),
                    )
                if exact_names:
                    keep = list(t.names)
                    marks = ",".join("?" * len(keep))
                    self._db.execute(
                        "DELETE FROM template_names WHERE template_id=?"
                        + (f" AND name NOT IN ({marks})" if keep else ""),
                        (t.template_id, *keep),
                    )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def template(self, id_or_name: str) -> TemplateRecord | None:
        rows = self._run("SELECT id, doc FROM templates WHERE id=?", (id_or_name,))
        if not rows:
            rows = self._run(
                "SELECT t.id, t.doc FROM templates t JOIN template_names n ON n.template_id=t.id "
                "WHERE n.name=?",
                (id_or_name,),
            )
        if not rows:
            return None
        tid, doc = rows[0]
        return TemplateRecord.from_doc(tid, json.loads(doc), self._names(tid))

    def templates(self) -> list[TemplateRecord]:
        return [
            TemplateRecord.from_doc(tid, json.loads(doc), self._names(tid))
            for tid, doc in self._run("SELECT id, doc FROM templates ORDER BY id")
        ]

    def _names(self, template_id: str) -> list[str]:
        rows = self._run(
            "SELECT name FROM template_names WHERE template_id=? ORDER BY rowid", (template_id,)
        )
        return [n for (n,) in rows]

    def delete_template(self, template_id: str) -> bool:
        with self._lock:
            self._db.execute("DELETE FROM template_names WHERE template_id=?", (template_id,))
            cur = self._db.execute("DELETE FROM templates WHERE id=?", (template_id,))
            return cur.rowcount > 0

    # --- async conveniences for the server ---
    async def aput_sandbox(self, r: SandboxRecord) -> None:
        await asyncio.to_thread(self.put_sandbox, r)

    async def adelete_sandbox(self, sandbox_id: str) -> None:
        await asyncio.to_thread(self.delete_sandbox, sandbox_id)
