"""With `AENV_LOG_FORMAT=json` uvicorn's own lines are JSON too: it gets no handlers of its
own and its loggers go through the process's."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from aenv.config import Settings
from aenv.logctx import configure
from aenv.proxy.ws import SERVER_OPTIONS
from aenv.serving import uvicorn_config


@pytest.fixture
def root_restored() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    loggers = {
        n: (logging.getLogger(n).handlers[:], logging.getLogger(n).propagate)
        for n in ("uvicorn", "uvicorn.error", "uvicorn.access")
    }
    for n in loggers:  # as in a fresh server process (other tests ran uvicorn's defaults)
        logging.getLogger(n).handlers[:] = []
        logging.getLogger(n).propagate = True
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for n, (h, p) in loggers.items():
        logging.getLogger(n).handlers[:] = h
        logging.getLogger(n).propagate = p


async def _app(scope: object, receive: object, send: object) -> None:
    return None


def test_uvicorns_lines_come_out_as_json(
    root_restored: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure("json")
    uvicorn_config(_app, Settings(), SERVER_OPTIONS)  # what uvicorn sets up for its loggers
    logging.getLogger("uvicorn.error").warning("Invalid HTTP request received.")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    doc = json.loads(line)
    assert doc["logger"] == "uvicorn.error" and doc["level"] == "warning"
    assert doc["message"] == "Invalid HTTP request received."
