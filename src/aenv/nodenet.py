"""The network names and addresses a node picks from its id when it is not told (several
nodes on one host): pure, no I/O."""

from __future__ import annotations

import hashlib
import ipaddress

# Nodes given an id take their slot range from here (a /19 each: 2048 slots), clear of the
# single-node default 10.200.0.0/16.
NODE_NETS = ipaddress.IPv4Network("10.64.0.0/10")
NODE_NET_PREFIXLEN = 19
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def node_network(node_id: str) -> tuple[str, str]:
    """The net prefix and slot range a node of this id uses unless told: stable across
    restarts (checkpoints keep working), distinct for distinct ids with high likelihood."""
    h = int.from_bytes(hashlib.sha256(node_id.encode()).digest()[:8], "big")
    count = 1 << (NODE_NET_PREFIXLEN - NODE_NETS.prefixlen)
    h, index = divmod(h, count)
    base = int(NODE_NETS.network_address) + (index << (32 - NODE_NET_PREFIXLEN))
    net = ipaddress.IPv4Network((base, NODE_NET_PREFIXLEN))
    name = ""
    for _ in range(4):
        h, d = divmod(h, 36)
        name = _DIGITS[d] + name
    return f"an{name}", str(net)
