"""The node's own networks: the IPv4 subnets the host sits on (its LAN), which no sandbox
may reach whatever its egress rules say (`Network._host_rules`, `egress_proxy`).

Read from `ip -j -4 addr show` in the root netns. A subnet counts when it is on an
interface that is

* not loopback (its range is a fixed deny of its own) and not a point-to-point device
  (tun, WireGuard, PPP: a tunnel, not a network of machines);
* not one of this node's slot veths (those are the sandboxes' range, denied separately);

and the address is of global scope with a prefix of /29 or shorter. /30 to /32 are
deliberately left out: such a "network" is a point-to-point link that holds this host and a
single peer (another aenv node's slot veths, a test's namespace standing in for the
internet, a routed uplink), through which other destinations are routed, not a LAN of
machines; the host's own addresses on them are refused anyway (the host never accepts a
connection from a sandbox). Nothing that overlaps the sandboxes' range counts either."""

from __future__ import annotations

import ipaddress
import json
import logging
import re
from typing import Any

from aenv.errors import RuntimeFailure
from aenv.runtime import _proc

log = logging.getLogger("aenv.runtime")

MAX_PREFIXLEN = 29


def own_networks(
    interfaces: list[dict[str, Any]], slot_if: re.Pattern[str], slot_cidr: ipaddress.IPv4Network
) -> list[ipaddress.IPv4Network]:
    """The subnets that count (see the module doc), in order, without duplicates."""
    found: list[ipaddress.IPv4Network] = []
    for itf in interfaces:
        flags = set(itf.get("flags") or [])
        name = str(itf.get("ifname") or "")
        if "LOOPBACK" in flags or "POINTOPOINT" in flags or slot_if.fullmatch(name):
            continue
        for a in itf.get("addr_info") or []:
            if a.get("family") != "inet" or a.get("scope") != "global" or "address" in a:
                continue  # `address` is a peer: a point-to-point address
            try:
                net = ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False)
            except (KeyError, ValueError):
                continue
            if net.prefixlen > MAX_PREFIXLEN or net.overlaps(slot_cidr) or net in found:
                continue
            found.append(net)
    return found


async def read_own_networks(
    slot_if: re.Pattern[str], slot_cidr: ipaddress.IPv4Network
) -> list[ipaddress.IPv4Network]:
    try:
        res = await _proc.run(["ip", "-j", "-4", "addr", "show"], time_limit=10)
        interfaces = json.loads(res.stdout)
    except (RuntimeFailure, ValueError) as e:
        raise RuntimeFailure(f"cannot read the node's networks: {e}") from e
    nets = own_networks(interfaces, slot_if, slot_cidr)
    shown = ", ".join(map(str, nets)) or "none"
    log.info("the node's own networks (never reachable from sandboxes): %s", shown)
    return nets
