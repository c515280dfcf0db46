"""Domain egress rules, the pure parts: entries, matching and the allow/deny decision
(`EgressPolicy`), the Host / SNI sniffers the egress proxy uses, the router's iptables
text, and which host networks count as the node's own."""

from __future__ import annotations

import ipaddress
import operator
import re
import ssl
import string
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv.domain import EgressPolicy, domain_matches
from aenv.runtime.net import sniff
from aenv.runtime.net.egress_proxy import PROXY_PORT
from aenv.runtime.net.egress_rules import EGRESS_CHAIN, egress_rules
from aenv.runtime.net.host_nets import own_networks


def client_hello(server_name: str | None) -> bytes:
    """The first flight of a real TLS client (Python's ssl), up to the ClientHello."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


# Entries ------------------------------------------------------------------------------------


def test_domains_are_accepted_and_normalized() -> None:
    p = EgressPolicy(
        allow_out=["Example.COM.", " *.Wild.Test ", "8.8.8.8"], deny_out=["bad.test", "0.0.0.0/0"]
    ).normalized()
    assert p.allow_out == ["example.com", "*.wild.test", "8.8.8.8/32"]
    assert (p.allow_domains, p.allow_cidrs) == (["example.com", "*.wild.test"], ["8.8.8.8/32"])
    assert (p.deny_domains, p.deny_cidrs) == (["bad.test"], ["0.0.0.0/0"])
    assert p.has_domains and not EgressPolicy(allow_out=["1.2.3.4"]).has_domains
    # A domain in allowOut opens DNS: E2B's default nameserver, the given ones, or none.
    assert p.resolvers == ["8.8.8.8"]
    names = ["allowed.test"]
    assert EgressPolicy(allow_out=names, dns_servers=["203.0.113.53"]).resolvers == ["203.0.113.53"]
    assert EgressPolicy(allow_out=names, dns_servers=[]).resolvers == []
    assert EgressPolicy(deny_out=names).resolvers == []
    assert EgressPolicy(allow_out=["1.2.3.4"], dns_servers=["1.1.1.1"]).resolvers == []


@pytest.mark.parametrize(
    "entry",
    [
        "*",
        "*.",
        "a..b",
        "-a.com",
        "a-.com",
        "a b.com",
        "a.*.com",
        "x" * 64 + ".com",
        "10.0.0.300",
        "1.2.3",
        "::1",
        "",
        "ex ample.com",
        "a/b.com",
        "é.com",
    ],
)
def test_bad_entries_are_refused(entry: str) -> None:
    with pytest.raises(ValueError, match="allowOut"):
        EgressPolicy(allow_out=[entry]).normalized()


def test_wildcards_match_names_under_the_domain_only() -> None:
    assert domain_matches("example.com", "example.com")
    assert not domain_matches("example.com", "www.example.com")
    assert domain_matches("*.example.com", "www.example.com")
    assert domain_matches("*.example.com", "a.b.example.com")
    assert not domain_matches("*.example.com", "example.com")
    assert not domain_matches("*.example.com", "badexample.com")
    assert not domain_matches("example.com", "notexample.com")


# A DNS label: [a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?, composed rather than `from_regex` (whose
# lazily imported module CPython 3.11.7 once failed to parse mid-run: "AST constructor
# recursion depth mismatch").
_ALNUM = string.ascii_lowercase + string.digits
_label = st.builds(
    operator.add,
    st.sampled_from(_ALNUM),
    st.just("")
    | st.builds(operator.add, st.text(_ALNUM + "-", max_size=8), st.sampled_from(_ALNUM)),
)
_name = st.lists(_label, min_size=1, max_size=4).map(".".join)


@given(base=_name, sub=_name)
def test_a_wildcard_matches_exactly_the_proper_subdomains(base: str, sub: str) -> None:
    assert domain_matches(f"*.{base}", f"{sub}.{base}")
    assert not domain_matches(f"*.{base}", base)
    assert domain_matches(base, base) and not domain_matches(base, f"{sub}.{base}")
    assert not domain_matches(f"*.{base}", f"{sub}{base}") or f"{sub}{base}".endswith(f".{base}")


# The decision --------------------------------------------------------------------------------


def test_allow_by_name_beats_deny_all() -> None:
    p = EgressPolicy(allow_out=["allowed.test", "*.wild.test"], deny_out=["0.0.0.0/0"]).normalized()
    assert p.allows("203.0.113.10", "allowed.test")
    assert p.allows("203.0.113.10", "ALLOWED.test.")
    assert p.allows("203.0.113.10", "a.wild.test")
    assert not p.allows("203.0.113.10", "denied.test")
    assert not p.allows("203.0.113.10", "wild.test")
    assert not p.allows("203.0.113.10", None)  # no name: only the address entries


def test_allow_wins_over_deny_for_names_and_addresses() -> None:
    p = EgressPolicy(allow_out=["ok.test"], deny_out=["ok.test", "*.test"]).normalized()
    assert p.allows("198.51.100.1", "ok.test")
    assert not p.allows("198.51.100.1", "other.test")
    assert p.allows("198.51.100.1", "other.example")  # internet allowed otherwise
    p = EgressPolicy(allow_out=["203.0.113.20"], deny_out=["*.test"]).normalized()
    assert p.allows("203.0.113.20", "x.test")  # allowed address, denied name: allow wins
    assert not p.allows("203.0.113.10", "x.test")
    closed = EgressPolicy(allow_internet=False, allow_out=["ok.test"]).normalized()
    assert closed.allows("203.0.113.10", "ok.test")
    assert not closed.allows("203.0.113.10", "other.test")
    assert closed.allows("8.8.8.8", None)  # the default DNS server is opened with a domain


# Sniffing ------------------------------------------------------------------------------------


def test_sni_of_a_real_client_hello() -> None:
    hello = client_hello("Allowed.Test")
    assert sniff.tls_sni(hello) == "allowed.test"
    assert sniff.tls_sni(client_hello(None)) is None
    assert sniff.tls_sni(b"GET / HTTP/1.1\r\n") is None
    assert sniff.tls_sni(b"") == sniff.MORE


@given(st.integers(min_value=0, max_value=2000))
def test_sni_of_a_partial_client_hello_asks_for_more(cut: int) -> None:
    hello = client_hello("a.wild.test")
    got = sniff.tls_sni(hello[: min(cut, len(hello) - 1)])
    assert got == sniff.MORE


def test_http_host() -> None:
    assert sniff.http_host(b"GET / HTTP/1.1\r\nHost: Allowed.Test:80\r\n\r\n") == "allowed.test"
    assert sniff.http_host(b"GET / HTTP/1.1\r\nhost:x.test\r\nA: b\r\n\r\n") == "x.test"
    assert sniff.http_host(b"GET / HTTP/1.0\r\n\r\n") is None  # no Host
    assert sniff.http_host(b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n") is None
    assert sniff.http_host(b"\x16\x03\x01\x02\x00") is None  # TLS on port 80
    assert sniff.http_host(b"SSH-2.0-OpenSSH\r\n") is None
    assert sniff.http_host(b"GE") == sniff.MORE
    assert sniff.http_host(b"GET / HTTP/1.1\r\nUser-Agent: x\r\n") == sniff.MORE
    assert sniff.http_host(b"GET / HTTP/1.1\r\nHo") == sniff.MORE


@given(st.binary(max_size=600))
def test_sniffers_never_fail_on_garbage(data: bytes) -> None:
    for f in (sniff.tls_sni, sniff.http_host):
        got = f(data)
        assert got is None or isinstance(got, str)
        if got not in (None, sniff.MORE):
            assert re.fullmatch(r"[a-z0-9_.-]+", got)


@given(st.binary(max_size=300), st.integers(min_value=0, max_value=400))
def test_sni_of_a_mangled_client_hello_never_fails(noise: bytes, at: int) -> None:
    hello = bytearray(client_hello("x.test"))
    at = min(at, len(hello))
    hello[at : at + len(noise)] = noise
    got = sniff.tls_sni(bytes(hello))
    assert got is None or isinstance(got, str)


# iptables text -------------------------------------------------------------------------------


def test_domain_rules_redirect_80_and_443_and_keep_dns_open() -> None:
    p = EgressPolicy(
        allow_out=["allowed.test"], deny_out=["0.0.0.0/0"], dns_servers=["203.0.113.53"]
    )
    lines = egress_rules(p).splitlines()
    c = EGRESS_CHAIN
    assert lines == [
        "*filter",
        f":{c} - [0:0]",
        f"-A {c} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
        f"-A {c} -d 203.0.113.53/32 -j ACCEPT",
        f"-A {c} -d 0.0.0.0/0 -p tcp -j REJECT --reject-with tcp-reset",
        f"-A {c} -d 0.0.0.0/0 -j REJECT --reject-with icmp-port-unreachable",
        "COMMIT",
        "*nat",
        f":{c} - [0:0]",
        f"-A {c} -p tcp -m multiport --dports 80,443 -j REDIRECT --to-ports {PROXY_PORT}",
        "COMMIT",
    ]
    # Address rules only: nothing redirected, no DNS exception.
    text = egress_rules(EgressPolicy(deny_out=["0.0.0.0/0"], dns_servers=["203.0.113.53"]))
    assert "REDIRECT" not in text and "203.0.113.53" not in text


# The node's own networks -----------------------------------------------------------------------


def _itf(name: str, *addrs: dict[str, Any], flags: tuple[str, ...] = ("UP",)) -> dict[str, Any]:
    return {"ifname": name, "flags": list(flags), "addr_info": list(addrs)}


def _a(cidr: str, scope: str = "global", **extra: Any) -> dict[str, Any]:
    ip, plen = cidr.split("/")
    return {"family": "inet", "local": ip, "prefixlen": int(plen), "scope": scope, **extra}


def test_own_networks_are_the_lan_subnets_only() -> None:
    interfaces = [
        _itf("lo", _a("127.0.0.1/8", "host"), flags=("LOOPBACK", "UP")),
        _itf("eth0", _a("192.168.1.17/24"), _a("10.9.8.7/16"), _a("169.254.3.3/16", "link")),
        _itf("eth1", _a("172.20.0.5/24")),
        _itf("br0", _a("192.168.1.1/24")),  # the same subnet again
        _itf("aenvh3", _a("10.200.0.13/30")),  # our slot veth
        _itf("aexph1", _a("10.207.0.5/30")),  # another node's slot veth: a /30 link
        _itf("aeegxab12", _a("192.0.2.1/30")),  # a test's fake internet link
        _itf("wg0", _a("10.66.0.1/24"), flags=("POINTOPOINT", "UP")),
        _itf("tun1", _a("10.77.0.1/32", address="10.77.0.2")),
        _itf("weird", _a("10.200.5.1/24")),  # overlaps the sandboxes' range
    ]
    nets = own_networks(
        interfaces, re.compile(r"aenvh(\d+)"), ipaddress.IPv4Network("10.200.0.0/16")
    )
    assert [str(n) for n in nets] == ["192.168.1.0/24", "10.9.0.0/16", "172.20.0.0/24"]
