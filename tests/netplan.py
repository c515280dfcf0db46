"""This test session's own network names and address ranges.

Two test sessions may run on one host at once (two `make test` in two clones): every
interface, namespace, iptables chain and cgroup a test makes is named from a prefix of its
own session, every range it routes or assigns is its session's, and start-up and teardown
purge only those. A session holds the first free of `SESSIONS` numbered lock files (flock:
freed when the process ends, however it ends) and its number picks everything below, so a
crashed session's leftovers are purged by the next session that takes its number.

Ranges, clear of the node's default 10.200.0.0/16 and of the 10.64.0.0/10 nodes with an id
derive theirs from: slot ranges are /20s (1024 slots) in 10.234.0.0-10.249.255.255, 32 per
session; the fake internet's targets a /27 of 203.0.113.0/24, the fake LAN a /27 of
198.51.100.0/24 and the host's links /30s of 10.250.<session>.0/24.
"""

from __future__ import annotations

import fcntl
import ipaddress
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

SESSIONS = 8
LOCKS = Path(tempfile.gettempdir()) / "aenv-test-sessions"

# One entry per node or runtime the suite starts with its own slot range; three letters each,
# so that no session's prefix is the beginning of another's.
TAGS = (
    "srv",  # the session's server (integration/conftest.py)
    "rgv",  # test_runtime_gvisor*.py (one module at a time)
    "rrc",  # test_runtime_gvisor_restore.py, reconcile after a restart
    "rco",  # test_runtime_contract.py
    "rcr",  # test_runtime_contract.py, restart
    "egr",  # test_egress.py
    "edn",  # test_egress_domains.py
    "crs",  # test_crash.py
    "tls",  # test_keys_tls.py
    "dom",  # test_domains.py
    "rst",  # test_snapshots.py, restart
    "hib",  # test_snapshots.py, hibernation
    "tpl",  # test_templates_images.py, the small layer cache's node
    "con",  # test_console.py
    "s3a",  # test_durable.py, first node
    "s3b",  # test_durable.py, second node
    "prm",  # test_prometheus_scrape.py
    "sec",  # test_secrets_egress.py
    "qco",  # test_runtime_qemu.py (the contract under QEMU)
    "qcr",  # test_runtime_qemu.py, restart
    "qsd",  # test_sdk_qemu.py (a node on the QEMU backend)
)
_FIRST_SLOT_NET = ipaddress.IPv4Address("10.234.0.0")
_PER_SESSION = 32  # SESSIONS * 32 /20s end at 10.249.255.255
assert len(TAGS) <= _PER_SESSION
_SLOT_PREFIXLEN = 20


def _claim() -> tuple[int, IO[str]]:
    LOCKS.mkdir(parents=True, exist_ok=True)
    LOCKS.chmod(0o1777)
    for n in range(SESSIONS):
        f = (LOCKS / f"{n}.lock").open("a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        return n, f
    raise RuntimeError(f"more than {SESSIONS} test sessions run on this host at once")


SESSION, _LOCK = _claim()
_BASE = f"a{SESSION}"


@dataclass(frozen=True)
class SlotNet:
    """What a node or runtime of this session is given: AENV_NET_PREFIX, AENV_NET_CIDR."""

    prefix: str
    cidr: str

    def astuple(self) -> tuple[str, str]:
        return self.prefix, self.cidr


def slot_net(tag: str) -> SlotNet:
    index = TAGS.index(tag)
    size = 1 << (32 - _SLOT_PREFIXLEN)
    first = int(_FIRST_SLOT_NET) + (SESSION * _PER_SESSION + index) * size
    net = ipaddress.IPv4Network((first, _SLOT_PREFIXLEN))
    return SlotNet(f"{_BASE}{tag}", str(net))


def name(tag: str) -> str:
    """A host-wide name (a namespace, an interface base, a node id) of this session's."""
    return f"{_BASE}{tag}"


def _block(network: str, prefixlen: int) -> ipaddress.IPv4Network:
    return list(ipaddress.IPv4Network(network).subnets(new_prefix=prefixlen))[SESSION]


@dataclass(frozen=True)
class Link:
    """A /30 between the host and a namespace of a test's own."""

    host: str
    peer: str


def link(n: int) -> Link:
    """This session's n-th link (0 or 1): /30s of 10.250.<session>.0/24. Not a documentation
    range: a machine may sit on one (this one's uplink is 192.0.2.0/24), and a host's own
    networks are what sandboxes must never reach."""
    assert n in (0, 1)
    sub = list(_block("10.250.0.0/16", 24).subnets(new_prefix=30))[n]
    hosts = list(sub.hosts())
    return Link(str(hosts[0]), str(hosts[1]))


def targets() -> ipaddress.IPv4Network:
    """The fake internet's addresses: a /27 of 203.0.113.0/24 routed to it from the host."""
    return _block("203.0.113.0/24", 27)


def lan() -> ipaddress.IPv4Network:
    """The fake LAN: a /27 of 198.51.100.0/24 the host sits on."""
    return _block("198.51.100.0/24", 27)
