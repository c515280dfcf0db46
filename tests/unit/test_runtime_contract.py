"""The runtime contract against the in-memory fake, and the fake's own test controls."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from aenv.domain import EgressPolicy
from aenv.errors import RuntimeFailure
from aenv.runtime.base import Instance, Runtime
from aenv.runtime.fake import Call, FakeHost, FakeRuntime, FakeState
from tests.contract.runtime_contract import RuntimeContract, Specs
from tests.helpers import async_wait_until


@pytest.fixture
def specs(tmp_path: Path) -> Specs:
    layer = tmp_path / "layer"
    layer.mkdir()
    return Specs(layers=[layer], args=["/bin/init"], uppers=tmp_path / "uppers")


@pytest_asyncio.fixture
async def runtime() -> AsyncIterator[FakeRuntime]:
    rt = FakeRuntime()
    await rt.start(set())
    yield rt
    # Every contract test destroys what it made.
    assert rt.instances() == []


class FakeRuntimes:
    def __init__(self) -> None:
        self.host = FakeHost()

    def new(self) -> Runtime:
        return FakeRuntime(self.host)

    async def crash(self, rt: Runtime) -> None:
        """A fake runtime holds nothing of the host's: dropping it is all a crash does."""


@pytest.fixture
def runtimes() -> FakeRuntimes:
    return FakeRuntimes()


class TestFakeRuntime(RuntimeContract):
    pass


# The fake's controls ---------------------------------------------------------------------------


async def test_fail_next_fails_one_call_without_effect(runtime: FakeRuntime, specs: Specs) -> None:
    inst = await runtime.create(specs("f-a"))
    runtime.fail_next("freeze")
    with pytest.raises(RuntimeFailure, match="injected failure of freeze"):
        await runtime.freeze(inst)
    assert runtime.state(inst) is FakeState.RUNNING
    await runtime.freeze(inst)  # only the next one failed
    assert runtime.state(inst) is FakeState.FROZEN
    await runtime.destroy(inst)


async def test_fail_next_after_some_calls(
    runtime: FakeRuntime, specs: Specs, tmp_path: Path
) -> None:
    """Partial failure of a fan-out: the second restore of three fails."""
    parent = await runtime.create(specs("f-par"))
    await runtime.checkpoint(parent, tmp_path / "img", leave_running=True)
    runtime.fail_next("restore", OSError("disk full"), after=1)
    results: list[Instance | OSError] = []
    for n in range(3):
        try:
            results.append(await runtime.restore(specs(f"f-kid{n}"), tmp_path / "img"))
        except OSError as e:
            results.append(e)
    assert [type(r).__name__ for r in results] == ["Instance", "OSError", "Instance"]
    restores = [c for c in runtime.calls if c.op == "restore"]
    assert [c.sandbox_id for c in restores] == ["f-kid0", "f-kid1", "f-kid2"]
    assert [c.error is not None for c in restores] == [False, True, False]
    for inst in runtime.instances():
        await runtime.destroy(inst)


async def test_before_hook_can_hold_an_operation(runtime: FakeRuntime, specs: Specs) -> None:
    inst = await runtime.create(specs("f-hold"))
    gate = asyncio.Event()
    seen: list[Call] = []

    async def hold(call: Call) -> None:
        seen.append(call)
        await gate.wait()

    runtime.before("stop", hold)
    stopping = asyncio.create_task(runtime.stop(inst))
    await async_wait_until(lambda: seen, 10, 0.001, "the stop to reach its hook")
    assert not stopping.done() and runtime.state(inst) is FakeState.RUNNING
    gate.set()
    await stopping
    assert runtime.is_stopped(inst) and [c.instance_id for c in seen] == [inst.id]
    await runtime.destroy(inst)


async def test_call_log_and_unknown_ops(runtime: FakeRuntime, specs: Specs) -> None:
    inst = await runtime.create(specs("f-log"))
    await runtime.alive(inst)
    await runtime.destroy(inst)
    assert runtime.ops() == ["start", "create", "alive", "destroy"]
    with pytest.raises(ValueError, match="unknown runtime operation"):
        runtime.fail_next("explode")


async def test_a_container_that_died_is_not_recovered(specs: Specs) -> None:
    host = FakeHost()
    rt1 = FakeRuntime(host)
    await rt1.start(set())
    a = await rt1.create(specs("f-dead"))
    host.kill(a.id)
    assert not await rt1.alive(a) and rt1.state(a) is FakeState.EXITED
    rt2 = FakeRuntime(host)
    assert await rt2.start({a.id}) == {}
    assert rt2.state(a) is FakeState.GONE


async def test_slots_are_reused_and_bounded(specs: Specs) -> None:
    rt = FakeRuntime(FakeHost(capacity=2))
    await rt.start(set())
    a = await rt.create(specs("f-s1"))
    b = await rt.create(specs("f-s2"))
    with pytest.raises(RuntimeFailure, match="no free network slot"):
        await rt.create(specs("f-s3"))
    await rt.destroy(a)
    c = await rt.create(specs("f-s3"))
    assert c.address == a.address and c.address != b.address
    with pytest.raises(RuntimeFailure, match="not started"):
        await FakeRuntime().create(specs("f-cold"))


async def test_egress_policy_is_kept_per_container(runtime: FakeRuntime, specs: Specs) -> None:
    closed = EgressPolicy(allow_internet=False, allow_out=["203.0.113.10"])
    a = await runtime.create(specs("f-eg", egress=closed))
    b = await runtime.create(specs("f-eg2"))
    assert runtime.egress(a) == closed and runtime.egress(b) is None
    opened = EgressPolicy(deny_out=["198.51.100.0/24"])
    await runtime.set_egress(b, opened)
    assert runtime.egress(b) == opened and runtime.egress(a) == closed
    with pytest.raises(ValueError):
        await runtime.set_egress(a, EgressPolicy(allow_out=["exa mple.com"]))
    assert runtime.egress(a) == closed
    assert [c.egress for c in runtime.calls if c.op == "set_egress"][0] == opened
    await runtime.destroy(a)
    await runtime.destroy(b)
    assert runtime.egress(a) is None
    with pytest.raises(RuntimeFailure, match="does not exist"):
        await runtime.set_egress(a, opened)
    assert runtime.ops()[-1] == "set_egress" and runtime.calls[-1].error is not None
