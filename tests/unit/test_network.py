"""Pure slot-address math and naming of network slots (no host changes)."""

from __future__ import annotations

import asyncio

import pytest

from aenv.config import Settings
from aenv.domain import EgressPolicy
from aenv.runtime.net.network import (
    EGRESS_CHAIN,
    GATEWAY_IP,
    SANDBOX_IP,
    SlotAddressing,
    egress_rules,
)


def test_slot_addresses_are_consecutive_30s() -> None:
    a = SlotAddressing("aenv", "10.200.0.0/16")
    assert a.capacity == 16384
    assert (a.host_ip(0), a.router_ip(0)) == ("10.200.0.1", "10.200.0.2")
    assert (a.host_ip(1), a.router_ip(1)) == ("10.200.0.5", "10.200.0.6")
    assert (a.host_ip(64), a.router_ip(64)) == ("10.200.1.1", "10.200.1.2")
    last = a.capacity - 1
    assert (a.host_ip(last), a.router_ip(last)) == ("10.200.255.253", "10.200.255.254")
    assert str(a.subnet(3)) == "10.200.0.12/30"


def test_slots_do_not_overlap_and_stay_in_range() -> None:
    a = SlotAddressing("aenv", "192.168.8.0/24")
    assert a.capacity == 64
    nets = [a.subnet(n) for n in range(a.capacity)]
    assert all(n.subnet_of(a.cidr) for n in nets)
    assert len({n.network_address for n in nets}) == a.capacity
    with pytest.raises(ValueError):
        a.subnet(a.capacity)
    with pytest.raises(ValueError):
        a.host_ip(-1)


def test_index_of_address_inverts_the_math() -> None:
    a = SlotAddressing("aenv", "10.200.0.0/16")
    for n in (0, 1, 77, a.capacity - 1):
        assert a.index_of_address(a.router_ip(n)) == n
        assert a.index_of_address(a.host_ip(n)) == n
    assert a.index_of_address("10.201.0.2") is None


def test_names_fit_linux_limits_and_parse_back() -> None:
    a = SlotAddressing("aenv", "10.200.0.0/16")
    s = a.slot(12)
    assert (s.router_ns, s.inner_ns, s.host_if) == ("aenv-12", "aenv-12-i", "aenvh12")
    assert s.netns_path == "/run/netns/aenv-12-i"
    assert len(a.host_if(a.capacity - 1)) <= 15
    assert a.parse_netns("aenv-12") == 12
    assert a.parse_netns("aenv-12-i") == 12
    assert a.parse_host_if("aenvh12") == 12
    # Other prefixes' names and unrelated names are not ours.
    for name in ("aenv2-1", "aenv-x", "aenvh", "aenv-1-j", "xaenv-1", "aenvh1h2", "aenv-"):
        assert a.parse_netns(name) is None
        assert a.parse_host_if(name) is None
    assert a.input_chain == "aenv-INPUT" and a.nat_chain == "aenv-POSTROUTING"


def test_same_inner_address_in_every_slot() -> None:
    assert SANDBOX_IP == "169.254.0.21" and GATEWAY_IP == "169.254.0.22"


def test_invalid_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="too long"):
        SlotAddressing("averylongpfx", "10.0.0.0/8")  # 12 + 'h' + 6 digits > 15
    SlotAddressing("averylongpfx", "10.0.0.0/24")  # 64 slots: fits
    with pytest.raises(ValueError):
        SlotAddressing("aenv", "10.0.0.0/31")
    with pytest.raises(ValueError):
        SlotAddressing("aenv", "10.0.0.1/16")  # host bits set
    with pytest.raises(ValueError):
        SlotAddressing("ae-nv", "10.0.0.0/16")
    with pytest.raises(ValueError):
        SlotAddressing("1aenv", "10.0.0.0/16")


def test_from_settings() -> None:
    a = SlotAddressing.from_settings(Settings(net_prefix="aetst", net_cidr="10.201.0.0/16"))
    assert a.router_ip(0) == "10.201.0.2" and a.host_if(3) == "aetsth3"


def test_an_open_policy_only_empties_the_egress_chain() -> None:
    c = EGRESS_CHAIN
    assert (
        egress_rules(EgressPolicy())
        == f"*filter\n:{c} - [0:0]\nCOMMIT\n*nat\n:{c} - [0:0]\nCOMMIT\n"
    )


def test_egress_rules_in_order_allow_then_deny_then_the_rest() -> None:
    policy = EgressPolicy(
        allow_internet=False, allow_out=["203.0.113.10", "10.1.2.3/8"], deny_out=["0.0.0.0/0"]
    )
    lines = egress_rules(policy).splitlines()
    c = EGRESS_CHAIN
    assert lines == [
        "*filter",
        f":{c} - [0:0]",
        f"-A {c} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
        f"-A {c} -d 203.0.113.10/32 -j ACCEPT",
        f"-A {c} -d 10.0.0.0/8 -j ACCEPT",
        f"-A {c} -d 0.0.0.0/0 -p tcp -j REJECT --reject-with tcp-reset",
        f"-A {c} -d 0.0.0.0/0 -j REJECT --reject-with icmp-port-unreachable",
        f"-A {c} -p tcp -j REJECT --reject-with tcp-reset",
        f"-A {c} -j REJECT --reject-with icmp-port-unreachable",
        "COMMIT",
        "*nat",
        f":{c} - [0:0]",
        "COMMIT",
    ]
    # Internet allowed: no final reject.
    assert "-A egress -j REJECT" not in egress_rules(EgressPolicy(deny_out=["1.2.3.4"]))


@pytest.mark.parametrize("entry", ["ex ample.com", "2001:db8::/32", "10.0.0.300", "", "1.2.3.4/33"])
def test_egress_entries_must_be_ipv4_or_domains(entry: str) -> None:
    with pytest.raises(ValueError):
        egress_rules(EgressPolicy(deny_out=[entry]))
    with pytest.raises(ValueError):
        egress_rules(EgressPolicy(allow_out=[entry]))


def test_egress_rules_already_in_force_are_not_restored_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restore re-arms its slot with the sandbox's policy: the same rules as the slot holds
    cost no iptables-restore; other rules, a rebuilt slot or a failed apply do."""
    from aenv.runtime.net import network as net_mod

    restores: list[str] = []
    fail = False

    async def fake_run(argv: list[str], **kw: object) -> object:
        if "iptables-restore" in argv:
            if fail:
                raise net_mod.RuntimeFailure("iptables-restore: failed")
            restores.append(str(kw["input"]))
        return None

    monkeypatch.setattr(net_mod._proc, "run", fake_run)
    net = net_mod.Network(SlotAddressing("aeunit", "10.99.0.0/24"))
    closed = EgressPolicy(allow_internet=False)

    async def go() -> None:
        nonlocal fail
        await net.apply_egress(3, closed)
        await net.apply_egress(3, closed)  # in force already
        assert len(restores) == 1
        await net.apply_egress(3, EgressPolicy())  # other rules
        await net.apply_egress(4, EgressPolicy())  # another slot
        assert len(restores) == 3
        await net.teardown(3)
        await net.apply_egress(3, EgressPolicy())  # a new slot 3: unknown rules
        assert len(restores) == 4
        fail = True
        with pytest.raises(net_mod.RuntimeFailure):
            await net.apply_egress(4, closed)
        fail = False
        await net.apply_egress(4, EgressPolicy())  # what is in force after a failure: unknown
        assert len(restores) == 5

    asyncio.run(go())
