"""Egress rules enforced in the network path, on real gVisor sandboxes (busybox, as in
gvisor_env.py) against a fake internet this module makes:

    host  <fake veth> H/30  <──>  P/30 eth0, netns of its own
          route T/27 via P                 A, B on its lo, a listener on :8080

(H, P, T: the session's own link and block of the documentation ranges, tests/netplan.py.)

The listener answers with the address it was reached at, so a probe knows which target it hit.
Own net prefix and range; the fake internet (listener, route, veth, netns) is removed by name
even when a test fails.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from aenv.domain import EgressPolicy
from aenv.runtime.base import Instance
from aenv.runtime.gvisor import GVisorRuntime
from aenv.runtime.net.network import SlotAddressing
from tests import netplan

from .fake_internet import NET_HOST, PORT, A, B, fake_internet
from .gvisor_env import make_rootfs, rec, spec, started_runtime
from .gvisor_net import host_nc, host_servers, probe, sh, wait_http

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("runsc") is None or not Path("/bin/busybox").exists(),
        reason="needs root, runsc and busybox-static",
    ),
]

__all__ = ["host_servers"]  # a fixture used here, imported for pytest to find

PREFIX, CIDR = netplan.slot_net("egr").prefix, netplan.slot_net("egr").cidr


@pytest.fixture(scope="module")
def internet() -> Iterator[None]:
    with fake_internet():
        yield


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_rootfs(tmp_path_factory.mktemp("egress-layer"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime(
    tmp_path_factory: pytest.TempPathFactory, internet: None
) -> AsyncIterator[GVisorRuntime]:
    async with started_runtime(tmp_path_factory.mktemp("egress-home"), PREFIX, CIDR) as rt:
        yield rt


async def reach(inst: Instance) -> dict[str, bool]:
    """From inside the sandbox: which of the two targets answer."""
    res = await probe(inst, [(A, PORT), (B, PORT)])
    return {ip: res[(ip, PORT)] for ip in (A, B)}


async def reach_quickly(inst: Instance) -> dict[str, bool]:
    """`reach`, and every target it cannot reach is refused at once (a reset or an ICMP
    error the client reports), not silently dropped until the client gives up."""
    res = await reach(inst)
    for ip, ok in res.items():
        if not ok:
            out = await sh(inst, f"nc -w 2 {ip} {PORT} </dev/null 2>&1; true")
            assert "refused" in out.lower(), out
    return res


async def start(
    rt: GVisorRuntime, rootfs: Path, name: str, egress: EgressPolicy | None
) -> Instance:
    inst = await rt.create(spec([rootfs], name, egress=egress))
    try:
        await wait_http(inst)  # the node reaches it whatever its egress rules
    except BaseException:
        await rt.destroy(inst)
        raise
    return inst


async def test_open_policy_reaches_both(runtime: GVisorRuntime, rootfs: Path) -> None:
    for name, egress in (("eg-none", None), ("eg-open", EgressPolicy())):
        inst = await start(runtime, rootfs, name, egress)
        try:
            assert await reach(inst) == {A: True, B: True}
        finally:
            await runtime.destroy(inst)


async def test_policies_at_create(runtime: GVisorRuntime, rootfs: Path) -> None:
    cases = [
        (EgressPolicy(deny_out=[A]), {A: False, B: True}),
        (EgressPolicy(allow_internet=False, allow_out=[f"{A}/32"]), {A: True, B: False}),
        # allow wins over deny
        (EgressPolicy(allow_out=[A], deny_out=["0.0.0.0/0"]), {A: True, B: False}),
        (EgressPolicy(allow_internet=False), {A: False, B: False}),
        (EgressPolicy(deny_out=["203.0.113.0/24"]), {A: False, B: False}),
    ]
    insts = await asyncio.gather(
        *(start(runtime, rootfs, f"eg-c{i}", p) for i, (p, _) in enumerate(cases))
    )
    try:
        for inst, (policy, want) in zip(insts, cases, strict=True):
            assert await reach_quickly(inst) == want, policy
    finally:
        await asyncio.gather(*(runtime.destroy(i) for i in insts))


async def test_set_egress_changes_a_running_sandbox_live(
    runtime: GVisorRuntime, rootfs: Path
) -> None:
    inst = await start(runtime, rootfs, "eg-live", None)
    try:
        assert await reach(inst) == {A: True, B: True}
        await runtime.set_egress(inst, EgressPolicy(deny_out=[B]))
        assert await reach_quickly(inst) == {A: True, B: False}
        await runtime.set_egress(inst, EgressPolicy(allow_internet=False, allow_out=[B]))
        assert await reach_quickly(inst) == {A: False, B: True}
        await runtime.freeze(inst)
        await runtime.set_egress(inst, EgressPolicy(deny_out=[A]))
        await runtime.thaw(inst)
        assert await reach_quickly(inst) == {A: False, B: True}
        await runtime.set_egress(inst, EgressPolicy())
        assert await reach(inst) == {A: True, B: True}
    finally:
        await runtime.destroy(inst)


async def test_rules_hold_across_hibernate_and_restore(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path
) -> None:
    only_a = EgressPolicy(allow_internet=False, allow_out=[A])
    inst = await start(runtime, rootfs, "eg-hib", only_a)
    again: Instance | None = None
    child: Instance | None = None
    try:
        assert await reach_quickly(inst) == {A: True, B: False}
        # A restore into a new slot with the rules in its spec.
        await runtime.checkpoint(inst, tmp_path / "fork", leave_running=True)
        child = await runtime.restore(
            spec([rootfs], "eg-kid", egress=EgressPolicy(deny_out=[A])), tmp_path / "fork"
        )
        assert rec(child).slot != rec(inst).slot
        await wait_http(child)
        assert await reach_quickly(child) == {A: False, B: True}
        assert await reach_quickly(inst) == {A: True, B: False}
        # Hibernate: checkpoint, stop, restore into its own slot.
        await runtime.checkpoint(inst, tmp_path / "hib", leave_running=False)
        await runtime.stop(inst)
        again = await runtime.restore(
            spec([rootfs], "eg-hib", egress=only_a), tmp_path / "hib", reuse=inst
        )
        assert again.address == inst.address
        await wait_http(again)
        assert await reach_quickly(again) == {A: True, B: False}
        # A change made while stopped is what the next start brings (the orchestrator passes
        # the current policy in the spec); a spec without rules opens the slot again.
        await runtime.checkpoint(again, tmp_path / "hib2", leave_running=False)
        await runtime.stop(again)
        await runtime.set_egress(again, EgressPolicy(deny_out=[B]))
        third = await runtime.restore(spec([rootfs], "eg-hib"), tmp_path / "hib2", reuse=again)
        again = third
        await wait_http(third)
        assert await reach(third) == {A: True, B: True}
    finally:
        if child is not None:
            await runtime.destroy(child)
        await runtime.destroy(again if again is not None else inst)


async def test_fixed_denies_hold_whatever_allow_out_says(
    runtime: GVisorRuntime, rootfs: Path, host_servers: tuple[int, int]
) -> None:
    public_port, local_port = host_servers
    everything = EgressPolicy(allow_internet=False, allow_out=["0.0.0.0/0"])
    inst = await start(runtime, rootfs, "eg-host", everything)
    other = await start(runtime, rootfs, "eg-other", None)
    try:
        own_host_ip = SlotAddressing(PREFIX, CIDR).host_ip(rec(inst).slot)
        host_side = [(own_host_ip, public_port), (NET_HOST, public_port)]
        for ip, port in host_side:  # sanity: the host serves there
            assert b"HTTP/1.0 200" in await asyncio.to_thread(host_nc, ip, port), ip
        targets = [
            *host_side,
            (own_host_ip, local_port),
            ("127.0.0.1", local_port),
            ("169.254.169.254", 80),
            (other.address, 49983),
            (A, PORT),
        ]
        res = await probe(inst, targets)
        assert res.pop((A, PORT)) is True, "allow_out 0.0.0.0/0 must reach the internet"
        assert not any(res.values()), res
    finally:
        await asyncio.gather(runtime.destroy(inst), runtime.destroy(other))
