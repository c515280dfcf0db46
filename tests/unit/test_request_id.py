"""Every API answer carries an `X-Request-Id` (the client's own when usable), log lines
written while handling it carry it, and `AENV_ACCESS_LOG` gives one line per request."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from aenv.logctx import JsonFormatter, SandboxIdFilter, TextFormatter, request_id_var
from tests.node_harness import Harness, started
from tests.unit.api_node import API_KEY, api_client


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    async for h in started(tmp_path, api_key=API_KEY, access_log=True):
        yield h


@pytest.fixture
async def client(node: Harness) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(node) as c:
        yield c


async def test_every_answer_has_an_id_of_its_own(client: httpx.AsyncClient) -> None:
    answers = [
        await client.get("/sandboxes"),
        await client.get("/sandboxes/nope"),  # a 404
        await client.post("/sandboxes", content=b"{", headers={"content-type": "application/json"}),
        await client.get("/health", headers={"X-API-Key": ""}),
    ]
    ids = [r.headers.get("x-request-id") for r in answers]
    assert all(ids) and len(set(ids)) == len(ids), ids
    assert [r.status_code for r in answers][:2] == [200, 404]


async def test_a_usable_client_id_is_kept_and_another_replaced(client: httpx.AsyncClient) -> None:
    r = await client.get("/sandboxes", headers={"X-Request-Id": "trace-42.a:b"})
    assert r.headers["x-request-id"] == "trace-42.a:b"
    bad = "x" * 200
    r = await client.get("/sandboxes", headers={"X-Request-Id": bad})
    assert r.headers["x-request-id"] not in (bad, "")


async def test_the_access_log_names_the_request(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="aenv.access"):
        r = await client.get("/sandboxes/nope", headers={"X-Request-Id": "req-7"})
    lines = [rec for rec in caplog.records if rec.name == "aenv.access"]
    assert r.status_code == 404 and len(lines) == 1
    assert lines[0].getMessage().startswith("GET /sandboxes/nope 404 ")
    assert getattr(lines[0], "request_id", None) == "req-7"


def test_lines_written_during_a_request_carry_its_id() -> None:
    record = logging.LogRecord("aenv.orchestrator", logging.INFO, __file__, 1, "x", None, None)
    token = request_id_var.set("req-9")
    try:
        SandboxIdFilter().filter(record)
    finally:
        request_id_var.reset(token)
    assert json.loads(JsonFormatter().format(record))["request_id"] == "req-9"
    assert TextFormatter().format(record).endswith(" request_id=req-9")
