"""The sandbox a log line is about, on every line: a context variable set around work for
one sandbox (lifecycle operations, boots, the timers' per-sandbox steps, proxied requests),
read by a logging filter, and two formats (`text`: `... sandbox_id=ID`, `json`: one object
a line) chosen by `AENV_LOG_FORMAT`.

A context variable rather than a `LoggerAdapter` so that every module's plain
`log.info(...)` below an operation — runtime, images, snapshots — carries the id without
being handed it; asyncio copies it into the tasks an operation starts."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import UTC, datetime

sandbox_id_var: ContextVar[str | None] = ContextVar("aenv_sandbox_id", default=None)
# The API request a line is about (`X-Request-Id`), when it is about one.
request_id_var: ContextVar[str | None] = ContextVar("aenv_request_id", default=None)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextlib.contextmanager
def sandbox_context(sandbox_id: str | None) -> Iterator[None]:
    """Log lines inside are about `sandbox_id` (None: about no sandbox)."""
    token = sandbox_id_var.set(sandbox_id)
    try:
        yield
    finally:
        sandbox_id_var.reset(token)


def about(sandbox_id: str) -> None:
    """The rest of the current operation is about `sandbox_id` (a create, once its id is
    known); the enclosing `sandbox_context` puts back what was before."""
    sandbox_id_var.set(sandbox_id)


class SandboxIdFilter(logging.Filter):
    """Puts the current sandbox id and request id on each record (`record.sandbox_id`,
    `record.request_id`, None if none)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "sandbox_id"):
            record.sandbox_id = sandbox_id_var.get()
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        sid = getattr(record, "sandbox_id", None)
        rid = getattr(record, "request_id", None)
        line = f"{line} sandbox_id={sid}" if sid else line
        return f"{line} request_id={rid}" if rid else line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        sid = getattr(record, "sandbox_id", None)
        if sid:
            out["sandbox_id"] = sid
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(fmt: str = "text", level: int = logging.INFO) -> None:
    """The server's root handler: stderr, the chosen format, the sandbox id on each line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(SandboxIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
