"""The iptables rules of a sandbox's egress policy, in its router netns (see `network`):
the filter chain for addresses and the nat chain that sends ports 80/443 to the egress
proxy when the policy names domains or has header transforms. Pure text; `Network.apply_egress` installs it."""

from __future__ import annotations

from aenv.domain import EgressPolicy
from aenv.runtime.net.egress_proxy import PROXY_PORT, REDIRECTED_PORTS

EGRESS_CHAIN = "egress"  # in each router netns (so no prefix: nothing else lives there)


def egress_rules(policy: EgressPolicy) -> str:
    """`iptables-restore --noflush` input that rewrites a router's egress chains in one
    transaction (no moment without rules). Filter: replies of established connections pass,
    then (with a domain in `allow_out`) the DNS servers it opens, then the address entries of
    `allow_out` accept, those of `deny_out` reject, and the rest is rejected unless
    `allow_internet`. Nat: with domain rules or header transforms, TCP to ports 80 and 443
    goes to the slot's egress proxy, which applies the whole policy there. An open policy leaves both chains
    empty. ValueError for an entry that is neither an IPv4 address or block nor a domain
    (`EgressPolicy.normalized`).

    Rejects answer at once (TCP reset, else ICMP port unreachable) so a refused connection
    fails fast in the sandbox instead of hanging until its timeout."""
    p = policy.normalized()
    c = EGRESS_CHAIN
    # Declaring an existing user chain under --noflush flushes it (legacy and nft alike).
    lines = ["*filter", f":{c} - [0:0]"]
    if not p.is_open:
        lines.append(f"-A {c} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT")
        lines += [f"-A {c} -d {dns}/32 -j ACCEPT" for dns in p.resolvers]
        lines += [f"-A {c} -d {net} -j ACCEPT" for net in p.allow_cidrs]
        for net in p.deny_cidrs:
            lines += _reject(f"-A {c} -d {net}")
        if not p.allow_internet:
            lines += _reject(f"-A {c}")
    lines += ["COMMIT", "*nat", f":{c} - [0:0]"]
    if p.proxied:
        ports = ",".join(map(str, REDIRECTED_PORTS))
        lines.append(
            f"-A {c} -p tcp -m multiport --dports {ports} -j REDIRECT --to-ports {PROXY_PORT}"
        )
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def _reject(match: str) -> list[str]:
    return [
        f"{match} -p tcp -j REJECT --reject-with tcp-reset",
        f"{match} -j REJECT --reject-with icmp-port-unreachable",
    ]
