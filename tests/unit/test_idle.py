"""Naps of idle sandboxes on the whole orchestrator over the fake runtime: who naps (no
request for `nap_after` seconds and next to no CPU), that any request ends the nap before
it reaches the sandbox, that work inside ends it too and keeps the sandbox awake a while,
and that the sampler's round reads no envd journal."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.domain import ENVD_PORT, CreateRequest, SandboxRecord, SandboxState
from aenv.runtime import naps
from aenv.runtime.fake import FakeState
from tests.node_harness import Harness, started


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    async for h in started(tmp_path, nap_after=10.0):
        yield h


def napping(h: Harness, r: SandboxRecord) -> bool:
    rec = h.orch.table.get(r.sandbox_id)
    assert rec.instance is not None
    return rec.instance.id in h.runtime.napping


async def idle_for(h: Harness, seconds: float) -> None:
    for _ in range(int(seconds // 5)):
        h.clock.advance(5)
        await h.orch.sampler.round()


async def test_an_idle_sandbox_naps_after_nap_after_and_a_request_wakes_it(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    await idle_for(node, 5)
    assert not napping(node, r)  # 5 s without a request: not yet
    await idle_for(node, 10)
    assert napping(node, r)
    await node.orch.pauser.resolve(r.sandbox_id, ENVD_PORT)
    assert not napping(node, r)
    await idle_for(node, 5)
    assert not napping(node, r)  # the request started its idle time again


async def test_a_sandbox_that_works_never_naps(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    node.runtime.cpu_pct[r.sandbox_id] = 25.0  # half a core of its two
    await idle_for(node, 60)
    assert not napping(node, r)


async def test_work_inside_ends_a_nap_and_keeps_the_sandbox_awake_a_while(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    await idle_for(node, 15)
    assert napping(node, r)
    node.runtime.cpu_pct[r.sandbox_id] = 2.5  # 0.05 cores: a job woke up in there
    await idle_for(node, 5)
    assert not napping(node, r)
    node.runtime.cpu_pct[r.sandbox_id] = 0.0
    await idle_for(node, 30)
    assert not napping(node, r)  # held awake after working
    await idle_for(node, 40)
    assert napping(node, r)


async def test_operations_wake_a_napping_sandbox_first(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    await idle_for(node, 15)
    assert napping(node, r)
    woke_before: list[bool] = []

    def on_checkpoint(_call: object) -> None:
        woke_before.append(not node.runtime.napping)

    node.runtime.before("checkpoint", on_checkpoint)
    await node.orch.snapshotter.snapshot(r.sandbox_id, "naps")
    assert woke_before == [True]


async def test_nap_after_zero_means_never(tmp_path: Path) -> None:
    async for h in started(tmp_path, nap_after=0):
        r = await h.orch.sandboxes.create(CreateRequest())
        await idle_for(h, 60)
        assert not napping(h, r)


async def test_sampling_reads_no_journal_and_logs_still_do(node: Harness) -> None:
    r = await node.orch.sandboxes.create(CreateRequest())
    assert r.address is not None
    node.envd.log(r.address, "process started", pid="7")
    await idle_for(node, 30)
    assert node.envd.journal_reads == []
    assert "process started" in [e.message for e in await node.orch.logs.read(r.sandbox_id)]
    assert node.envd.journal_reads == [(r.address, 0)]


def test_naps_set_and_clear_the_timer_slack_of_every_thread_of_a_cgroup(tmp_path: Path) -> None:
    # A fake cgroup tree naming this process's own threads (writing the slack of one's own
    # threads needs no privilege).
    ev = threading.Event()
    t = threading.Thread(target=ev.wait)
    t.start()
    try:
        assert t.native_id is not None
        tids = [os.getpid(), t.native_id]
        d = tmp_path / "freezer" / "aenv" / "box"
        d.mkdir(parents=True)
        (d / "tasks").write_text("".join(f"{x}\n" for x in tids) + "999999999\n")
        assert naps.set_slack("/aenv/box", naps.NAP_SLACK_NS, root=tmp_path) == 2
        assert [naps.slack_of(x) for x in tids] == [naps.NAP_SLACK_NS] * 2
        assert naps.set_slack("/aenv/box", 0, root=tmp_path) == 2
        assert all(naps.slack_of(x) < naps.NAP_SLACK_NS for x in tids)
    finally:
        ev.set()
        t.join()


# ---------------------------------------------------------------------------- standby
def frozen(h: Harness, r: SandboxRecord) -> bool:
    rec = h.orch.table.get(r.sandbox_id)
    assert rec.instance is not None
    return h.runtime.state(rec.instance) is FakeState.FROZEN


async def test_standby_freezes_a_calm_sandbox_and_any_request_thaws_it(tmp_path: Path) -> None:
    async for h in started(tmp_path, nap_after=10.0, standby_after=30.0):
        r = await h.orch.sandboxes.create(CreateRequest())
        await idle_for(h, 25)
        assert napping(h, r) and not frozen(h, r)
        await idle_for(h, 10)
        assert frozen(h, r)
        # Still running to its user, timeout unchanged.
        rec = h.orch.table.get(r.sandbox_id)
        assert rec.state is SandboxState.RUNNING and rec.end_at == r.end_at
        assert [x.sandbox_id for x in h.orch.table.list(states={"running"})] == [r.sandbox_id]
        await h.orch.pauser.resolve(r.sandbox_id, ENVD_PORT)
        assert not frozen(h, r) and not napping(h, r)
        # Operations thaw it first, too: a snapshot and a kill of a sandbox in standby.
        await idle_for(h, 40)
        assert frozen(h, r)
        await h.orch.snapshotter.snapshot(r.sandbox_id, "from-standby")
        assert not frozen(h, r)
        await idle_for(h, 40)
        assert frozen(h, r)
        await h.orch.sandboxes.kill(r.sandbox_id)
        assert h.orch.table.list() == []


async def test_a_sandbox_whose_job_runs_never_goes_to_standby(tmp_path: Path) -> None:
    async for h in started(tmp_path, nap_after=10.0, standby_after=20.0):
        r = await h.orch.sandboxes.create(CreateRequest())
        h.runtime.cpu_pct[r.sandbox_id] = 0.5  # 0.01 cores: a counter ticking in there
        await idle_for(h, 120)
        assert not frozen(h, r)


async def test_standby_is_per_sandbox_and_off_by_default(node: Harness) -> None:
    plain = await node.orch.sandboxes.create(CreateRequest())
    opted = await node.orch.sandboxes.create(CreateRequest(standby_after=15))
    await idle_for(node, 30)
    assert not frozen(node, plain) and frozen(node, opted)
