"""Network slots: an inner netns per sandbox, behind a router netns with a unique host address.

Slot N (names from `settings.net_prefix`, here `P`):

    root netns            router netns `P-N`                 inner netns `P-N-i` (given to runsc)
    PhN  10.x.y.1/30 <──> up0 10.x.y.2/30
                          gw0 169.254.0.22/30  <──────────>  eth0 169.254.0.21/30 (via .22)

* The in-sandbox address is the same in every slot, so a checkpoint restores into any slot.
* The router DNATs everything sent to its `up0` address to the sandbox, and SNATs the sandbox's
  outgoing traffic to that address; the node reaches every port of the sandbox at the router
  address (`Slot.router_ip`). Slot N uses the Nth /30 of `settings.net_cidr`.
* Host rules (root netns, our own chains named after the prefix, so cleanup is exact):
  - `P-INPUT` (first in INPUT): packets from our host veths `Ph+` to the host itself are
    dropped unless they belong to a connection the host opened. So a sandbox reaches no host
    service: not via the veth address, not via the host's other addresses, not 127.0.0.1.
  - `P-FORWARD` (first in FORWARD): drops veth-to-veth traffic (sandbox to sandbox), traffic
    to link-local 169.254.0.0/16 (cloud metadata) and to the node's own networks (its LAN, read
    at start-up: `host_nets`), accepts the rest of the egress and its replies.
  - `P-POSTROUTING` (nat): MASQUERADE for the range, leaving the host.
  - `net.ipv4.ip_forward=1`.
* Router netns: INPUT from `gw0` is dropped (the sandbox cannot talk to the router itself).
  FORWARD from `gw0` jumps to the chain `egress` (`EGRESS_CHAIN`): the sandbox's own egress
  rules (`apply_egress`, from an `EgressPolicy`). It is made empty with the slot, so an open
  policy costs nothing. A packet this chain accepts still crosses the host's `P-INPUT` and
  `P-FORWARD` on its way out of the router, so the fixed denies above (host, other sandboxes,
  link-local, the node's networks) hold whatever the policy allows: no entry can open them.
* Domain rules: nat PREROUTING from `gw0` jumps to a nat chain `egress` too; with domains in
  the policy it redirects new TCP connections to ports 80 and 443 to the slot's egress proxy
  (`egress_proxy`, listening in the router netns on the gateway address; INPUT accepts
  exactly those redirected connections), which decides by Host / SNI and connects from the
  router netns, through the same host chains.

Slots are built ahead of time by a small warm pool. Once runsc used an inner netns it has moved
eth0's address into its netstack, so `release` tears the slot down and the pool builds fresh
ones. The one exception is a stopped sandbox (`Runtime.stop`) that keeps its slot: `rearm`
puts the address back before the same sandbox is restored into it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from aenv.config import Settings
from aenv.domain import EgressPolicy
from aenv.errors import RuntimeFailure
from aenv.runtime import _proc
from aenv.runtime.net.egress_proxy import PROXY_PORT, EgressProxies
from aenv.runtime.net.egress_rules import EGRESS_CHAIN, egress_rules
from aenv.runtime.net.host_nets import read_own_networks

log = logging.getLogger("aenv.runtime")

SANDBOX_IP = "169.254.0.21"
GATEWAY_IP = "169.254.0.22"
LINK_PREFIXLEN = 30
NETNS_DIR = Path("/run/netns")
SYS_NET = Path("/sys/class/net")
IFNAMSIZ = 15  # usable characters of a Linux interface name


@dataclass(frozen=True)
class Slot:
    index: int
    host_ip: str
    router_ip: str
    host_if: str
    router_ns: str
    inner_ns: str

    @property
    def netns_path(self) -> str:
        """The inner netns, as the OCI spec's `linux.namespaces[network].path`."""
        return str(NETNS_DIR / self.inner_ns)


class SlotAddressing:
    """Pure naming and address math of slots (no side effects)."""

    def __init__(self, prefix: str, cidr: str) -> None:
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", prefix):
            raise ValueError(f"net_prefix {prefix!r}: use letters, digits and _ only")
        try:
            net = ipaddress.IPv4Network(cidr, strict=True)
        except ValueError as e:
            raise ValueError(f"net_cidr {cidr!r}: {e}") from e
        if net.prefixlen > LINK_PREFIXLEN:
            raise ValueError(f"net_cidr {cidr!r} is smaller than one /{LINK_PREFIXLEN}")
        self.prefix = prefix
        self.cidr = net
        self.capacity = net.num_addresses >> (32 - LINK_PREFIXLEN)
        longest = self.host_if(self.capacity - 1)
        if len(longest) > IFNAMSIZ:
            raise ValueError(
                f"net_prefix {prefix!r} is too long for {self.capacity} slots: "
                f"interface name {longest!r} exceeds {IFNAMSIZ} characters"
            )
        self._ns_re = re.compile(rf"{re.escape(prefix)}-(\d+)(?:-i)?")
        self._if_re = re.compile(rf"{re.escape(prefix)}h(\d+)")

    @classmethod
    def from_settings(cls, settings: Settings) -> SlotAddressing:
        return cls(settings.net_prefix, settings.net_cidr)

    def _check(self, n: int) -> None:
        if not 0 <= n < self.capacity:
            raise ValueError(f"slot {n} outside 0..{self.capacity - 1} of {self.cidr}")

    def subnet(self, n: int) -> ipaddress.IPv4Network:
        self._check(n)
        base = int(self.cidr.network_address) + (n << (32 - LINK_PREFIXLEN))
        return ipaddress.IPv4Network((base, LINK_PREFIXLEN))

    def host_ip(self, n: int) -> str:
        return str(self.subnet(n).network_address + 1)

    def router_ip(self, n: int) -> str:
        return str(self.subnet(n).network_address + 2)

    def router_ns(self, n: int) -> str:
        return f"{self.prefix}-{n}"

    def inner_ns(self, n: int) -> str:
        return f"{self.prefix}-{n}-i"

    def host_if(self, n: int) -> str:
        return f"{self.prefix}h{n}"

    def slot(self, n: int) -> Slot:
        return Slot(
            index=n,
            host_ip=self.host_ip(n),
            router_ip=self.router_ip(n),
            host_if=self.host_if(n),
            router_ns=self.router_ns(n),
            inner_ns=self.inner_ns(n),
        )

    def index_of_address(self, address: str) -> int | None:
        """The slot whose /30 holds `address`, or None."""
        ip = ipaddress.IPv4Address(address)
        if ip not in self.cidr:
            return None
        return (int(ip) - int(self.cidr.network_address)) >> (32 - LINK_PREFIXLEN)

    def parse_netns(self, name: str) -> int | None:
        m = self._ns_re.fullmatch(name)
        return int(m.group(1)) if m else None

    def parse_host_if(self, name: str) -> int | None:
        m = self._if_re.fullmatch(name)
        return int(m.group(1)) if m else None

    # iptables chains of this prefix (root netns).
    @property
    def input_chain(self) -> str:
        return f"{self.prefix}-INPUT"

    @property
    def forward_chain(self) -> str:
        return f"{self.prefix}-FORWARD"

    @property
    def nat_chain(self) -> str:
        return f"{self.prefix}-POSTROUTING"

    @property
    def if_pattern(self) -> re.Pattern[str]:
        """Matches the names of this prefix's host veths."""
        return self._if_re

    @property
    def if_wildcard(self) -> str:
        return f"{self.prefix}h+"


class Network:
    """Builds and removes slots and the host-wide rules; no bookkeeping of its own."""

    def __init__(self, addressing: SlotAddressing) -> None:
        self.addr = addressing
        # Read by `setup_host`; fixed denies of the host rules and of the egress proxies.
        self.own_networks: list[ipaddress.IPv4Network] = []
        self.proxies = EgressProxies(GATEWAY_IP, self._proxy_denies)
        # Rules this process put in force per slot: the same again skips iptables-restore.
        self._rules_in_force: dict[int, str] = {}

    def _proxy_denies(self) -> list[ipaddress.IPv4Network]:
        return [*self.own_networks, self.addr.cidr]

    # Host-wide rules ---------------------------------------------------------------------

    def _host_rules(self) -> str:
        a = self.addr
        veths = a.if_wildcard
        own = "".join(
            f"-A {a.forward_chain} -i {veths} -d {n} -j DROP\n" for n in self.own_networks
        )
        return f"""*filter
:{a.input_chain} - [0:0]
:{a.forward_chain} - [0:0]
-A {a.input_chain} -i {veths} -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN
-A {a.input_chain} -i {veths} -j DROP
-A {a.forward_chain} -i {veths} -o {veths} -j DROP
-A {a.forward_chain} -i {veths} -d 169.254.0.0/16 -j DROP
{own}-A {a.forward_chain} -i {veths} -j ACCEPT
-A {a.forward_chain} -o {veths} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
COMMIT
*nat
:{a.nat_chain} - [0:0]
-A {a.nat_chain} -s {a.cidr} ! -d {a.cidr} -j MASQUERADE
COMMIT
"""

    def _jumps(self) -> list[tuple[str, str, str]]:
        a = self.addr
        return [
            ("filter", "INPUT", a.input_chain),
            ("filter", "FORWARD", a.forward_chain),
            ("nat", "POSTROUTING", a.nat_chain),
        ]

    async def setup_host(self) -> None:
        """Idempotent: (re)writes our chains and puts their jumps first in the built-in ones."""
        self.own_networks = await read_own_networks(self.addr.if_pattern, self.addr.cidr)
        lines = [
            "set -e",
            "echo 1 > /proc/sys/net/ipv4/ip_forward",
            "iptables-restore -w --noflush <<'EOF'",
            self._host_rules().rstrip("\n"),
            "EOF",
        ]
        for table, builtin, chain in self._jumps():
            # Remove every jump, then insert exactly one at the top.
            lines.append(
                f"while iptables -w -t {table} -D {builtin} -j {chain} 2>/dev/null; do :; done"
            )
            lines.append(f"iptables -w -t {table} -I {builtin} 1 -j {chain}")
        await _proc.run(["/bin/sh", "-c", "\n".join(lines)], time_limit=30)

    async def remove_host(self) -> None:
        """Removes our chains and jumps (ip_forward is left as it is)."""
        lines = []
        for table, builtin, chain in self._jumps():
            lines.append(
                f"while iptables -w -t {table} -D {builtin} -j {chain} 2>/dev/null; do :; done"
            )
            lines.append(f"iptables -w -t {table} -F {chain} 2>/dev/null")
            lines.append(f"iptables -w -t {table} -X {chain} 2>/dev/null")
        lines.append("true")
        await _proc.run(["/bin/sh", "-c", "\n".join(lines)], time_limit=30)

    # Slots -------------------------------------------------------------------------------

    def _build_script(self, s: Slot) -> str:
        plen = LINK_PREFIXLEN
        return f"""set -e
ip -batch - <<EOF
netns add {s.router_ns}
netns add {s.inner_ns}
link add {s.host_if} type veth peer name up0 netns {s.router_ns}
address add {s.host_ip}/{plen} dev {s.host_if}
link set {s.host_if} up
EOF
ip -n {s.router_ns} -batch - <<EOF
link set lo up
address add {s.router_ip}/{plen} dev up0
link set up0 up
route add default via {s.host_ip}
link add gw0 type veth peer name eth0 netns {s.inner_ns}
address add {GATEWAY_IP}/{plen} dev gw0
link set gw0 up
EOF
ip -n {s.inner_ns} -batch - <<EOF
link set lo up
address add {SANDBOX_IP}/{plen} dev eth0
link set eth0 up
route add default via {GATEWAY_IP}
EOF
nsenter --net={NETNS_DIR / s.router_ns} /bin/sh -c \\
  'echo 1 > /proc/sys/net/ipv4/ip_forward && exec iptables-restore -w' <<EOF
*nat
:{EGRESS_CHAIN} - [0:0]
-A PREROUTING -i up0 -d {s.router_ip} -j DNAT --to-destination {SANDBOX_IP}
-A PREROUTING -i gw0 -j {EGRESS_CHAIN}
-A POSTROUTING -o up0 -s {SANDBOX_IP} -j SNAT --to-source {s.router_ip}
COMMIT
*filter
:{EGRESS_CHAIN} - [0:0]
-A INPUT -i gw0 -d {GATEWAY_IP} -p tcp --dport {PROXY_PORT} -m conntrack --ctstate DNAT -j ACCEPT
-A INPUT -i gw0 -j DROP
-A FORWARD -i gw0 -j {EGRESS_CHAIN}
COMMIT
EOF
"""

    async def build(self, n: int) -> Slot:
        """Creates slot `n` (about 15-20 ms); on any failure removes what was made."""
        slot = self.addr.slot(n)
        t0 = time.perf_counter()
        self._rules_in_force.pop(n, None)
        try:
            await _proc.run(["/bin/sh", "-c", self._build_script(slot)], time_limit=30)
        except BaseException:
            await asyncio.shield(self.teardown(n))
            raise
        log.debug("slot %d built in %.1f ms", n, (time.perf_counter() - t0) * 1000)
        return slot

    async def rearm(self, n: int) -> None:
        """Makes a used slot usable again for a new sandbox (a stopped sandbox's restore).

        runsc moves eth0's address and routes of the inner netns into its netstack, and they
        are gone when the sandbox exits; this puts them back (idempotent)."""
        s = self.addr.slot(n)
        batch = (
            f"address replace {SANDBOX_IP}/{LINK_PREFIXLEN} dev eth0\n"
            "link set eth0 up\n"
            "link set lo up\n"
            f"route replace default via {GATEWAY_IP}\n"
        )
        t0 = time.perf_counter()
        await _proc.run(["ip", "-n", s.inner_ns, "-batch", "-"], input=batch, time_limit=30)
        log.debug("slot %d re-armed in %.1f ms", n, (time.perf_counter() - t0) * 1000)

    async def apply_egress(self, n: int, policy: EgressPolicy) -> None:
        """Replaces the egress rules of slot `n` atomically (see `egress_rules`) and starts,
        updates or stops its egress proxy; works with or without a sandbox in the slot.
        RuntimeFailure when the slot is gone."""
        rules = egress_rules(policy)
        p = policy.normalized()
        ns = NETNS_DIR / self.addr.router_ns(n)
        t0 = time.perf_counter()
        if p.proxied:  # listening before anything is redirected to it
            try:
                await self.proxies.apply(n, str(ns), p)
            except OSError as e:
                raise RuntimeFailure(f"egress proxy of slot {n}: {e}") from e
        if self._rules_in_force.get(n) != rules:
            self._rules_in_force.pop(n, None)  # unknown until this one succeeds
            await _proc.run(
                ["nsenter", f"--net={ns}", "iptables-restore", "-w", "--noflush"],
                input=rules,
                time_limit=30,
                what=f"egress rules of slot {n}",
            )
            self._rules_in_force[n] = rules
        if not p.proxied:
            await self.proxies.stop(n)
        log.debug("slot %d egress rules in %.1f ms", n, (time.perf_counter() - t0) * 1000)

    async def teardown(self, n: int) -> None:
        """Deletes the host veth and both netns of slot `n`; missing parts are fine."""
        self._rules_in_force.pop(n, None)
        await self.proxies.stop(n)
        a = self.addr
        batch = f"link del {a.host_if(n)}\nnetns del {a.router_ns(n)}\nnetns del {a.inner_ns(n)}\n"
        await _proc.run(["ip", "-force", "-batch", "-"], input=batch, check=False, time_limit=30)

    def _scan(self) -> set[int]:
        found: set[int] = set()
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(NETNS_DIR):
                n = self.addr.parse_netns(name)
                if n is not None:
                    found.add(n)
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(SYS_NET):
                n = self.addr.parse_host_if(name)
                if n is not None:
                    found.add(n)
        return found

    async def existing(self) -> set[int]:
        """Indices of slots with any trace on the host (a netns or a host veth)."""
        return await asyncio.to_thread(self._scan)

    async def close(self) -> None:
        """Stops every egress proxy (the rules stay; the next start serves them again)."""
        await self.proxies.close()

    async def cleanup(self, keep: set[int]) -> set[int]:
        """Tears down every slot of our prefix not in `keep`; returns the removed indices."""
        stale = await self.existing() - keep
        sem = asyncio.Semaphore(8)

        async def one(n: int) -> None:
            async with sem:
                await self.teardown(n)

        await asyncio.gather(*(one(n) for n in stale))
        return stale


class SlotPool:
    """Keeps `size` slots ready and hands them out; slots are torn down on release."""

    def __init__(self, network: Network, size: int) -> None:
        self.network = network
        self.size = max(0, size)
        self._ready: collections.deque[Slot] = collections.deque()
        # Every index with something on the host: ready, handed out, being built or removed.
        self._taken: set[int] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def ready(self) -> int:
        return len(self._ready)

    def start(self, reserved: set[int]) -> None:
        """Starts refilling; `reserved` are indices held by recovered sandboxes."""
        self._taken |= reserved
        self._closed = False
        if self._task is None and self.size > 0:
            self._task = asyncio.create_task(self._refill(), name="aenv-slot-pool")
        self._wake.set()

    def _reserve(self) -> int:
        capacity = self.network.addr.capacity
        for n in range(capacity):
            if n not in self._taken:
                self._taken.add(n)
                return n
        raise RuntimeFailure(f"no free network slot ({capacity} in {self.network.addr.cidr})")

    async def _build(self) -> Slot:
        n = self._reserve()
        try:
            return await self.network.build(n)
        except BaseException:
            self._taken.discard(n)
            raise

    async def acquire(self) -> Slot:
        """A ready slot when there is one, else one built now."""
        if self._ready:
            slot = self._ready.popleft()
        else:
            slot = await self._build()
        self._wake.set()
        return slot

    async def release(self, slot: Slot | int) -> None:
        n = slot.index if isinstance(slot, Slot) else slot
        try:
            await self.network.teardown(n)
        finally:
            self._taken.discard(n)

    async def _refill(self) -> None:
        failures = 0
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            while not self._closed and len(self._ready) < self.size:
                try:
                    slot = await self._build()
                except RuntimeFailure as e:
                    failures += 1
                    log.warning("building a network slot failed (%d): %s", failures, e)
                    await asyncio.sleep(min(30.0, 0.5 * 2 ** min(failures, 6)))
                    continue
                failures = 0
                if self._closed:
                    await self.release(slot)
                else:
                    self._ready.append(slot)

    async def close(self) -> None:
        """Stops refilling and tears down the unused ready slots."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        ready = list(self._ready)
        self._ready.clear()
        await asyncio.gather(*(self.release(s) for s in ready), return_exceptions=True)
