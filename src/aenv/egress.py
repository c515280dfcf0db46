"""A sandbox's egress policy (E2B's `network` settings): allowed and denied addresses and
domains, validated once. A leaf module: no I/O, no imports from the rest of aenv."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field


@dataclass
class EgressPolicy:
    """Where a sandbox may connect to, as its user set it (E2B's `allow_internet_access` and
    `network.allowOut` / `denyOut`). Entries are IPv4 addresses, CIDR blocks or domain names
    (`example.com`, `*.example.com`: every name under it, not the name itself). Evaluated in
    the network path, first match wins: the node's fixed denies (loopback, link-local and
    metadata addresses, the node's own networks, other sandboxes) that no entry can open,
    then `allow_out`, then `deny_out`, then everything else is allowed only with
    `allow_internet`.

    Domain entries apply where the name is on the wire, as in E2B: TCP port 80 by the HTTP
    Host header and port 443 by the TLS server name (SNI). There a connection is allowed
    when its name or its address is allowed, else refused when either is denied. Other
    ports and protocols only see the address entries. With a domain in `allow_out`, the
    DNS servers (`dns_servers`; None: E2B's default 8.8.8.8, []: none) are allowed too, all
    traffic to them, so names still resolve under a deny-all. As in E2B this only opens the
    path: the sandbox's /etc/resolv.conf is its own. Domains in `deny_out` go beyond E2B
    (which takes addresses only there); allow still wins over them."""

    allow_internet: bool = True
    allow_out: list[str] = field(default_factory=list)
    deny_out: list[str] = field(default_factory=list)
    # DNS servers kept reachable when `allow_out` has a domain (None: the default).
    dns_servers: list[str] | None = None

    @property
    def is_open(self) -> bool:
        """Nothing beyond the node's fixed denies (the default: no rules to install)."""
        return self.allow_internet and not self.allow_out and not self.deny_out

    def normalized(self) -> EgressPolicy:
        """The same policy with every address entry as a CIDR block (`8.8.8.8` →
        `8.8.8.8/32`) and every domain in lower case without a final dot; ValueError naming
        the first entry that is neither."""
        return EgressPolicy(
            allow_internet=self.allow_internet,
            allow_out=[_entry(e, "allowOut") for e in self.allow_out],
            deny_out=[_entry(e, "denyOut") for e in self.deny_out],
            dns_servers=None
            if self.dns_servers is None
            else [str(_address(e, "dnsServers")) for e in self.dns_servers],
        )

    # Views of a normalized policy.
    @property
    def allow_cidrs(self) -> list[str]:
        return [e for e in self.allow_out if not is_domain_entry(e)]

    @property
    def deny_cidrs(self) -> list[str]:
        return [e for e in self.deny_out if not is_domain_entry(e)]

    @property
    def allow_domains(self) -> list[str]:
        return [e for e in self.allow_out if is_domain_entry(e)]

    @property
    def deny_domains(self) -> list[str]:
        return [e for e in self.deny_out if is_domain_entry(e)]

    @property
    def has_domains(self) -> bool:
        return any(map(is_domain_entry, self.allow_out + self.deny_out))

    @property
    def resolvers(self) -> list[str]:
        """The DNS servers a domain in `allow_out` opens (all traffic to them); none without
        one."""
        if not self.allow_domains:
            return []
        return [DEFAULT_DNS_SERVER] if self.dns_servers is None else list(self.dns_servers)

    def allows(self, address: str, name: str | None = None) -> bool:
        """The user's rules (not the fixed denies) for a connection to `address`, whose
        Host / SNI was `name` (None: not known, only the address entries apply). Allow wins
        over deny. Expects a normalized policy."""
        ip = ipaddress.IPv4Address(address)
        if name is not None:
            name = name.lower().rstrip(".")
        nets = ipaddress.IPv4Network
        if any(ip in nets(c) for c in self.allow_cidrs):
            return True
        if name and any(domain_matches(d, name) for d in self.allow_domains):
            return True
        if address in self.resolvers:
            return True
        if any(ip in nets(c) for c in self.deny_cidrs):
            return False
        if name and any(domain_matches(d, name) for d in self.deny_domains):
            return False
        return self.allow_internet


# E2B keeps its default nameserver reachable whenever a domain rule is used.
DEFAULT_DNS_SERVER = "8.8.8.8"
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")


def is_domain_entry(entry: str) -> bool:
    """A normalized entry that is a domain (addresses and blocks have no letters or `*`)."""
    return any(c.isalpha() or c == "*" for c in entry)


def domain_matches(pattern: str, name: str) -> bool:
    """`example.com` matches itself only; `*.example.com` matches every name under
    example.com (any depth) but not example.com. Both in lower case, no final dot."""
    if pattern.startswith("*."):
        return name.endswith(pattern[1:]) and len(name) > len(pattern) - 1
    return name == pattern


def _address(entry: str, where: str) -> ipaddress.IPv4Address:
    try:
        return ipaddress.IPv4Address(entry.strip())
    except ValueError:
        raise ValueError(f"{where}: {entry!r} is not an IPv4 address") from None


def _entry(entry: str, where: str) -> str:
    text = entry.strip()
    try:
        return str(ipaddress.IPv4Network(text, strict=False))
    except ValueError:
        pass
    domain = _domain(text)
    if domain is None:
        raise ValueError(f"{where}: {entry!r} is not an IPv4 address, CIDR block or domain name")
    return domain


def _domain(text: str) -> str | None:
    """`text` as a normalized domain entry, or None when it is not one: dot-separated
    labels of letters, digits, `-` and `_` (a leading `*.` for a wildcard), at most 253
    characters, and a last label that is not all digits (that is a mistyped address)."""
    name = text.lower().rstrip(".") if text != "." else ""
    wildcard = name.startswith("*.")
    labels = (name[2:] if wildcard else name).split(".")
    if not name or len(name) > 253 or not all(_LABEL.fullmatch(x) for x in labels):
        return None
    if labels[-1].isdigit():
        return None
    return name
