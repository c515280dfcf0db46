"""Node admission: creates past the node's capacity are refused with a clear 429 or 503
(and the E2B error shape on the API), never started to fail later."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.domain import CreateRequest
from aenv.errors import TooManyRequests, Unavailable
from tests.node_harness import started


async def test_past_max_sandboxes_a_create_gets_429_until_one_is_killed(tmp_path: Path) -> None:
    async for h in started(tmp_path, max_sandboxes=2):
        a = await h.orch.create(CreateRequest())
        await h.orch.create(CreateRequest())
        with pytest.raises(TooManyRequests, match="maximum of 2 concurrent") as e:
            await h.orch.create(CreateRequest())
        assert e.value.status == 429
        assert len(h.orch.list()) == 2  # nothing half-made is listed
        await h.orch.kill(a.sandbox_id)
        await h.orch.create(CreateRequest())


async def test_past_the_memory_budget_a_create_gets_503(tmp_path: Path) -> None:
    async for h in started(tmp_path, max_memory_mb=1024):
        await h.orch.create(CreateRequest(memory_mb=768))
        with pytest.raises(Unavailable, match="not enough memory") as e:
            await h.orch.create(CreateRequest(memory_mb=512))
        assert e.value.status == 503


async def test_a_node_short_of_disk_refuses_creates(tmp_path: Path) -> None:
    async for h in started(tmp_path, min_free_disk_mb=10**9):
        with pytest.raises(Unavailable, match="not enough free disk") as e:
            await h.orch.create(CreateRequest())
        assert e.value.status == 503
        assert h.orch.list() == []
