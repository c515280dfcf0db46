"""A sandbox's egress policy (E2B's `network` settings): allowed and denied addresses and
domains, and per-host header transforms (`rules`) whose values may name secrets as
`${e2b.secrets.NAME}`, validated once. A leaf module: no I/O, no imports from the rest of
aenv."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass, field

# A header transform's values: the literal text with placeholders still in it.
HeaderMap = dict[str, str]
# (owner, secret name) → the secret's value, or None when the owner has no such secret.
SecretLookup = Callable[[str | None, str], str | None]


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
    # E2B's `network.rules`: host pattern (a domain, `*.domain`) → the headers of each of
    # its rules' `transform`, in order ({} for a rule without one). A matching HTTP or HTTPS
    # request gets them, replacing its own of the same name; placeholders are resolved at
    # egress only (`resolve_placeholders`). A host here is not allowed by it (`allow_out`
    # decides); hosts without rules are never intercepted.
    rules: dict[str, list[HeaderMap]] = field(default_factory=dict)
    # Whose secrets the placeholders name: the API key that created the sandbox (None:
    # AENV_API_KEY).
    owner: str | None = None

    @property
    def is_open(self) -> bool:
        """Nothing beyond the node's fixed denies (the default: no rules to install)."""
        return (
            self.allow_internet and not self.allow_out and not self.deny_out and not self.intercepts
        )

    @property
    def intercepts(self) -> bool:
        """Some host has a header transform: its traffic goes through the egress proxy,
        which terminates TLS for it."""
        return any(h for rules in self.rules.values() for h in rules)

    @property
    def proxied(self) -> bool:
        """Ports 80 and 443 go through the egress proxy (domain entries or transforms)."""
        return self.has_domains or self.intercepts

    def headers_for(self, name: str | None) -> HeaderMap | None:
        """The headers to set on a request to host `name` (lower case), placeholders still
        in them; None when no rule's host matches (the connection is not intercepted).
        Rules of wildcard patterns apply first, those of the exact name last (they win)."""
        if not name or not self.intercepts:
            return None
        hit = sorted((p for p in self.rules if domain_matches(p, name)), key=_exact_last)
        if not hit:
            return None
        out: HeaderMap = {}
        for pattern in hit:
            for headers in self.rules[pattern]:
                for key, value in headers.items():
                    for old in [k for k in out if k.lower() == key.lower()]:
                        del out[old]
                    out[key] = value
        return out

    def secret_names(self) -> set[str]:
        """The secrets the rules' placeholders name (canonical: lower case)."""
        return {
            n
            for rules in self.rules.values()
            for headers in rules
            for value in headers.values()
            for n in placeholder_names(value)
        }

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
            rules=_rules(self.rules),
            owner=self.owner,
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


# `${e2b.secrets.NAME}` (E2B's `Secret.fill`): a name is anything but braces and control
# characters; secrets are looked up by their canonical (lower-case) name.
PLACEHOLDER = re.compile(r"\$\{e2b\.secrets\.([^{}\x00-\x1f\x7f]+)\}")
# RFC 9110 field names; values without CR, LF or NUL (no header can be smuggled in).
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}")
_BAD_VALUE = re.compile(r"[\r\n\x00]")
MAX_RULE_HOSTS = 100
MAX_HEADERS = 64


class UnknownSecret(LookupError):
    """A placeholder names a secret its owner does not have."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def placeholder_names(value: str) -> list[str]:
    return [m.group(1).lower() for m in PLACEHOLDER.finditer(value)]


def resolve_placeholders(value: str, owner: str | None, lookup: SecretLookup) -> str:
    """`value` with every `${e2b.secrets.NAME}` replaced by the owner's secret; UnknownSecret
    for a name the owner has no secret of. Called at egress only, per request."""

    def one(m: re.Match[str]) -> str:
        found = lookup(owner, m.group(1).lower())
        if found is None:
            raise UnknownSecret(m.group(1).lower())
        return found

    return PLACEHOLDER.sub(one, value)


def _exact_last(pattern: str) -> tuple[bool, int]:
    return (not pattern.startswith("*."), len(pattern))


def _rules(rules: dict[str, list[HeaderMap]]) -> dict[str, list[HeaderMap]]:
    if len(rules) > MAX_RULE_HOSTS:
        raise ValueError(f"rules: at most {MAX_RULE_HOSTS} hosts")
    out: dict[str, list[HeaderMap]] = {}
    for host, host_rules in rules.items():
        domain = _domain(host.strip())
        if domain is None:
            raise ValueError(f"rules: {host!r} is not a domain name")
        out.setdefault(domain, []).extend(_headers(h, domain) for h in host_rules)
    return out


def _headers(headers: HeaderMap, host: str) -> HeaderMap:
    if len(headers) > MAX_HEADERS:
        raise ValueError(f"rules[{host!r}]: at most {MAX_HEADERS} headers in a transform")
    for key, value in headers.items():
        if not _HEADER_NAME.fullmatch(key):
            raise ValueError(f"rules[{host!r}]: {key!r} is not an HTTP header name")
        if _BAD_VALUE.search(value):
            raise ValueError(f"rules[{host!r}]: header {key!r} has a line break or NUL")
    return dict(headers)


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
