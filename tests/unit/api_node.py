"""The node's API over the real orchestrator on the fake runtime (`tests/node_harness.py`),
for the API's unit tests: a client on it, sandboxes the node made, E2B's error shape."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from aenv.domain import CreateRequest, SandboxRecord
from aenv.server import node_app
from tests.helpers import uvicorn_thread
from tests.node_harness import Harness

API_KEY = "e2b_test_key_0123456789"


def assert_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["code"] == status
    assert isinstance(body["message"], str) and body["message"]
    return dict(body)


@contextlib.asynccontextmanager
async def api_client(
    h: Harness, *, key: str | None = API_KEY, base_url: str = "http://test"
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the node's app in process (no lifespan: the harness started the node)."""
    app = node_app(h.settings, h.orch)
    headers = {"X-API-Key": key} if key else {}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url=base_url, headers=headers
    ) as c:
        yield c


@contextlib.contextmanager
def served(h: Harness, **config: Any) -> Iterator[str]:
    """The node served by uvicorn in a thread, as `aenv server` serves it: its lifespan
    starts the (built, not started) orchestrator and closes it. Yields the base URL."""
    try:
        with uvicorn_thread(node_app(h.settings, h.orch), **config) as url:
            yield url
    finally:
        h.catalog.close()


async def running(h: Harness, **fields: Any) -> SandboxRecord:
    """A sandbox the node made, one second of the node's clock after the one made before
    (so listings, which sort by start time, show them in the order they were made)."""
    h.clock.advance(1)
    return await h.orch.sandboxes.create(CreateRequest(**fields))


async def paused(h: Harness, **fields: Any) -> SandboxRecord:
    r = await running(h, **fields)
    await h.orch.pauser.pause(r.sandbox_id)
    return h.orch.table.get(r.sandbox_id)


def assert_nothing_created(h: Harness) -> None:
    """No sandbox, not even one the node started and then dropped."""
    assert h.orch.table.all() == []
    assert "create" not in h.runtime.ops()
