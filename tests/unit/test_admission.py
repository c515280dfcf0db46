"""Back-pressure on the whole orchestrator over the fake runtime: creates past what the boot
slots and their queue take are refused at once with 503 and `Retry-After` (not left to hang
and half-fail), a fork's children are admitted all together or not at all, and what was
admitted still starts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from aenv.domain import CreateRequest, Quota, SandboxState
from aenv.errors import TooManyRequests, Unavailable
from aenv.keys import KeyStore
from aenv.orchestrator import boot
from aenv.server import node_app
from tests.node_harness import Harness, started

API_KEY = "admission-test-key-0123456789"


async def queued(h: Harness, n: int = 1) -> None:
    """Until `n` boots wait for the one slot (the first holds it)."""
    booter = h.orch.sandboxes.booter
    for _ in range(500):
        if booter.waiting >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the boots did not queue")


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    # One boot slot, one create may wait for it; each boot takes 0.2 s.
    async for h in started(tmp_path, api_key=API_KEY, boot_concurrency=1, boot_queue=1):
        h.runtime.delay = 0.2
        yield h


async def test_creates_past_the_boot_queue_are_refused_at_once(node: Harness) -> None:
    first = asyncio.create_task(node.orch.sandboxes.create(CreateRequest()))
    second = asyncio.create_task(node.orch.sandboxes.create(CreateRequest()))
    await queued(node)  # the first holds the slot, the second waits
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(Unavailable) as refused:
        await node.orch.sandboxes.create(CreateRequest())
    assert loop.time() - t0 < 0.1  # at once, not after the others
    assert refused.value.retry_after is not None and refused.value.retry_after >= 1
    assert refused.value.headers()["Retry-After"].isdigit()
    made = await asyncio.gather(first, second)
    assert [r.state for r in made] == [SandboxState.RUNNING] * 2
    assert len(node.orch.table.list()) == 2  # the refused one left nothing behind
    # The queue drained: a create goes through again.
    assert (await node.orch.sandboxes.create(CreateRequest())).state is SandboxState.RUNNING


async def test_the_api_answers_503_with_retry_after(node: Harness) -> None:
    app = node_app(node.settings, node.orch)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://aenv",
        headers={"X-API-Key": API_KEY},
    ) as c:
        busy = [
            asyncio.create_task(c.post("/sandboxes", json={"templateID": "base"})) for _ in range(2)
        ]
        await queued(node)
        r = await c.post("/sandboxes", json={"templateID": "base"})
        assert r.status_code == 503
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["code"] == 503 and "busy starting sandboxes" in r.json()["message"]
        assert [b.status_code for b in await asyncio.gather(*busy)] == [201, 201]


async def test_a_fork_is_admitted_whole_or_refused_before_the_parent_is_touched(
    node: Harness,
) -> None:
    parent = await node.orch.sandboxes.create(CreateRequest())
    blockers = [asyncio.create_task(node.orch.sandboxes.create(CreateRequest())) for _ in range(2)]
    await queued(node)
    before = len(node.runtime.calls)
    with pytest.raises(Unavailable):
        await node.orch.forker.fork(parent.sandbox_id, 3)
    assert len(node.runtime.calls) == before  # no checkpoint, no child
    await asyncio.gather(*blockers)
    children = await node.orch.forker.fork(parent.sandbox_id, 3)  # 3 children > queue of 1: whole
    assert all(c.error is None for c in children)


async def test_a_key_past_its_quota_gets_429_and_others_go_on(node: Harness) -> None:
    node.runtime.delay = 0.0
    store = KeyStore.of(node.settings)
    small, _ = store.create("small", quota=Quota(max_sandboxes=2, max_memory_mb=10_000))
    other, _ = store.create("other")
    app = node_app(node.settings, node.orch)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://aenv"
    ) as c:

        async def create(key: str, **body: object) -> httpx.Response:
            return await c.post(
                "/sandboxes", json={"templateID": "base", **body}, headers={"X-API-Key": key}
            )

        made = [await create(small), await create(small)]
        assert [r.status_code for r in made] == [201, 201]
        r = await create(small)
        assert r.status_code == 429 and "'small' already runs 2" in r.json()["message"]
        assert (await create(other)).status_code == 201  # another key is not held back
        # Paused files-only, a sandbox holds no memory: it no longer counts.
        sid = made[0].json()["sandboxID"]
        await node.orch.pauser.pause(sid, memory=False)
        assert (await create(small)).status_code == 201
        # A fork counts its children; the memory limit counts memoryMB.
        parent = made[1].json()["sandboxID"]
        with pytest.raises(TooManyRequests):
            await node.orch.forker.fork(parent, 1)
        store.set_quota("small", Quota(max_memory_mb=1024 + 256))  # no restart needed
        r = await create(small, memoryMB=512)
        assert r.status_code == 429 and "MiB" in r.json()["message"]
        assert len([x for x in node.orch.table.list() if x.owner == "small"]) == 3


async def test_by_default_the_queue_holds_what_waits_up_to_max_queue_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without AENV_BOOT_QUEUE a create is refused when the boots ahead of it would take
    longer than MAX_QUEUE_WAIT at their recent pace (1 s each to start with)."""
    monkeypatch.setattr(boot, "MAX_QUEUE_WAIT", 1.5)
    async for h in started(tmp_path, boot_concurrency=1):
        h.runtime.delay = 0.2
        first = asyncio.create_task(h.orch.sandboxes.create(CreateRequest()))
        second = asyncio.create_task(
            h.orch.sandboxes.create(CreateRequest())
        )  # ~1 s to wait: queued
        await queued(h)
        with pytest.raises(Unavailable) as refused:
            await h.orch.sandboxes.create(CreateRequest())  # ~2 s to wait: refused
        assert refused.value.retry_after is not None and refused.value.retry_after >= 2
        assert [r.state for r in await asyncio.gather(first, second)] == [SandboxState.RUNNING] * 2


async def test_a_draining_node_refuses_a_fork_like_a_create(node: Harness) -> None:
    parent = await node.orch.sandboxes.create(CreateRequest())
    # What a drain sets first (the move itself needs a repository: the cluster's tests).
    node.orch.context.draining = True
    with pytest.raises(Unavailable, match="draining"):
        await node.orch.sandboxes.create(CreateRequest())
    with pytest.raises(Unavailable, match="draining"):
        await node.orch.forker.fork(parent.sandbox_id, 2)
    assert [r.sandbox_id for r in node.orch.table.list()] == [parent.sandbox_id]
    # Counted alike too, as a refusal of the node (503), by the parts that refused them.
    exposition = (await node.orch.stats.exposition()).decode()
    for op in ("create", "fork"):
        assert f'aenv_operation_errors_total{{code="503",op="{op}"}} 1.0' in exposition
    node.orch.mover.undrain()
    children = await node.orch.forker.fork(parent.sandbox_id, 2)
    assert all(c.error is None for c in children)


def _creates_counted(prometheus: bytes) -> float:
    for line in prometheus.decode().splitlines():
        if line.startswith('aenv_operation_duration_seconds_count{op="create"}'):
            return float(line.split()[-1])
    return 0.0


async def test_a_forks_children_are_counted_and_logged_as_created(node: Harness) -> None:
    parent = await node.orch.sandboxes.create(CreateRequest())
    before = _creates_counted(await node.orch.stats.exposition())
    children = await node.orch.forker.fork(parent.sandbox_id, 2)
    assert _creates_counted(await node.orch.stats.exposition()) == before + 2
    for child in children:
        assert child.sandbox is not None
        messages = [e.message for e in await node.orch.logs.read(child.sandbox.sandbox_id)]
        assert "sandbox created" in messages
