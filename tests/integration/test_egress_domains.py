"""Domain egress rules on real gVisor sandboxes (busybox) against the fake internet:
HTTP matched by its Host header, HTTPS by its TLS server name, wildcards, allow over deny,
live changes, a fork and a hibernated sandbox keeping them, DNS kept open; and the node's
own networks, which no rule opens.

allowed.test and denied.test live on the same address (`fake_internet.NAMES`), so only the
name can tell them apart. The node's "own network" is a namespace of this module's own on a
/24 of a documentation range, attached to the host before the runtime starts (so the
runtime counts it as the node's LAN)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import secrets
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from aenv.domain import EgressPolicy
from aenv.runtime.base import Instance
from aenv.runtime.gvisor import GVisorRuntime
from tests import netplan

from .fake_internet import DNS, PORT, A, B, fake_internet
from .gvisor_env import make_rootfs, rec, spec, started_runtime
from .gvisor_net import host_nc, sh, wait_http

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("runsc") is None or not Path("/bin/busybox").exists(),
        reason="needs root, runsc and busybox-static",
    ),
]

PREFIX, CIDR = netplan.slot_net("edn").prefix, netplan.slot_net("edn").cidr
LAN_HOST, LAN_PEER, LAN_PLEN = str(netplan.lan()[1]), str(netplan.lan()[7]), netplan.lan().prefixlen

# In the sandbox: a TLS client sending `$1` as its server name over the socket nc made.
TLS_CLIENT = """exec 3<&0
printf 'GET / HTTP/1.0\\r\\n\\r\\n' | ssl_client -s 3 -n "$1" >"$2" 2>/dev/null
"""
ONLY_NAMES = EgressPolicy(
    allow_out=["allowed.test", "*.wild.test"], deny_out=["0.0.0.0/0"], dns_servers=[DNS]
)


@contextlib.contextmanager
def fake_lan() -> Iterator[None]:
    """A namespace on a /24 the host sits on (a LAN as far as the node can tell), with
    HTTP on :80 and :8080 at LAN_PEER."""
    tok = secrets.token_hex(3)
    ns, veth = f"{netplan.name('ln')}-{tok}", f"{netplan.name('ln')}{tok}"
    setup = f"""set -e
ip netns add {ns}
ip link add {veth} type veth peer name eth0 netns {ns}
ip addr add {LAN_HOST}/{LAN_PLEN} dev {veth}; ip link set {veth} up
ip -n {ns} addr add {LAN_PEER}/{LAN_PLEN} dev eth0; ip -n {ns} link set eth0 up
ip -n {ns} link set lo up
ip -n {ns} route add default via {LAN_HOST}
"""
    server = (
        "import socket,threading\n"
        "def srv(p):\n"
        " s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        " s.bind(('0.0.0.0',p));s.listen(16)\n"
        " while True:\n"
        "  c=s.accept()[0];c.settimeout(3)\n"
        "  try:c.recv(1024);c.sendall(b'HTTP/1.0 200 OK\\r\\n\\r\\nlan\\n')\n"
        "  except Exception:pass\n"
        "  c.close()\n"
        "threading.Thread(target=srv,args=(80,),daemon=True).start();srv(8080)\n"
    )
    proc = None
    try:
        subprocess.run(["sh", "-c", setup], check=True)
        proc = subprocess.Popen(["ip", "netns", "exec", ns, "python3", "-c", server])
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture(scope="module")
def internet() -> Iterator[None]:
    with fake_internet(), fake_lan():
        yield


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_rootfs(tmp_path_factory.mktemp("egress-dom-layer"))
    (root / "bin" / "tls-get").write_text(TLS_CLIENT)
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime(
    tmp_path_factory: pytest.TempPathFactory, internet: None
) -> AsyncIterator[GVisorRuntime]:
    async with started_runtime(tmp_path_factory.mktemp("egress-dom-home"), PREFIX, CIDR) as rt:
        yield rt


async def start(
    rt: GVisorRuntime, rootfs: Path, name: str, egress: EgressPolicy | None
) -> Instance:
    inst = await rt.create(spec([rootfs], name, egress=egress))
    try:
        await wait_http(inst)
    except BaseException:
        await rt.destroy(inst)
        raise
    return inst


def http_cmd(ip: str, name: str, port: int = 80) -> str:
    return (
        f"printf 'GET / HTTP/1.1\\r\\nHost: {name}\\r\\nConnection: close\\r\\n\\r\\n'"
        f" | nc -w 3 {ip} {port} 2>&1"
    )


async def http(inst: Instance, ip: str, name: str) -> str:
    """The body line the fake internet answered a plain HTTP request with, or ''."""
    out = await sh(inst, http_cmd(ip, name) + "; true")
    return next((ln for ln in out.splitlines() if ln.startswith("http ")), "")


async def https(inst: Instance, ip: str, name: str) -> str:
    """The same over TLS with `name` as the server name."""
    f = f"/tmp/tls-{secrets.token_hex(3)}"
    out = await sh(inst, f"nc -w 3 {ip} 443 -e sh /bin/tls-get {name} {f}; cat {f}; true")
    return next((ln for ln in out.splitlines() if ln.startswith("https ")), "")


async def names(inst: Instance) -> dict[str, bool]:
    """Which of the test names answer, over HTTP and HTTPS (at the addresses DNS gives)."""
    checks = {
        "http allowed.test": http(inst, A, "allowed.test"),
        "http denied.test": http(inst, A, "denied.test"),
        "https allowed.test": https(inst, A, "allowed.test"),
        "https denied.test": https(inst, A, "denied.test"),
        "http x.wild.test": http(inst, B, "x.wild.test"),
        "https a.b.wild.test": https(inst, B, "a.b.wild.test"),
        "https wild.test": https(inst, B, "wild.test"),
    }
    got = await asyncio.gather(*checks.values())
    out = {}
    for key, line in zip(checks, got, strict=True):
        scheme, name = key.split()
        if line:  # what arrived is what was sent: the name went through untouched
            assert line.split()[0] == scheme and line.split()[2] == name, line
        out[key] = bool(line)
    return out


ALL_NAMES = {
    "http allowed.test": True,
    "http denied.test": True,
    "https allowed.test": True,
    "https denied.test": True,
    "http x.wild.test": True,
    "https a.b.wild.test": True,
    "https wild.test": True,
}
ONLY_ALLOWED = {
    **ALL_NAMES,
    "http denied.test": False,
    "https denied.test": False,
    "https wild.test": False,
}


async def plain(inst: Instance, ip: str, port: int = PORT) -> str:
    return await sh(inst, f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {ip} {port} 2>&1; true")


async def test_names_decide_http_and_https_under_deny_all(
    runtime: GVisorRuntime, rootfs: Path
) -> None:
    inst = await start(runtime, rootfs, "ed-names", ONLY_NAMES)
    try:
        assert await names(inst) == ONLY_ALLOWED
        # Other ports only see the address rules: denied, at once.
        assert "refused" in (await plain(inst, A)).lower()
        # The resolver stays reachable, and resolves the test names.
        out = await sh(inst, f"nslookup x.wild.test {DNS} 2>&1; true")
        assert B in out, out
    finally:
        await runtime.destroy(inst)


async def test_allow_beats_deny_and_the_rest_stays_open(
    runtime: GVisorRuntime, rootfs: Path
) -> None:
    policy = EgressPolicy(allow_out=["allowed.test", "*.wild.test"], deny_out=["*.test"])
    inst = await start(runtime, rootfs, "ed-deny", policy)
    try:
        assert await names(inst) == ONLY_ALLOWED
        assert f"ext {A}" in await plain(inst, A)  # no address rule: the internet is open
        # An allowed address opens every name on it (allow wins over a denied name).
        await runtime.set_egress(inst, EgressPolicy(allow_out=[A], deny_out=["*.test"]))
        got = await names(inst)
        assert got["http denied.test"] and got["https denied.test"]
        assert not got["http x.wild.test"] and not got["https a.b.wild.test"]
    finally:
        await runtime.destroy(inst)


async def test_live_changes_and_a_fork_and_a_hibernated_sandbox_keep_them(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path
) -> None:
    inst = await start(runtime, rootfs, "ed-live", None)
    again: Instance | None = None
    child: Instance | None = None
    try:
        assert await names(inst) == ALL_NAMES
        await runtime.set_egress(inst, ONLY_NAMES)
        assert await names(inst) == ONLY_ALLOWED
        await runtime.freeze(inst)
        await runtime.thaw(inst)
        assert await names(inst) == ONLY_ALLOWED
        # A fork: restored into another slot with the rules in its spec.
        await runtime.checkpoint(inst, tmp_path / "fork", leave_running=True)
        child = await runtime.restore(
            spec([rootfs], "ed-kid", egress=ONLY_NAMES), tmp_path / "fork"
        )
        assert rec(child).slot != rec(inst).slot
        await wait_http(child)
        assert await names(child) == ONLY_ALLOWED
        # Hibernated and restored into its own slot.
        await runtime.checkpoint(inst, tmp_path / "hib", leave_running=False)
        await runtime.stop(inst)
        again = await runtime.restore(
            spec([rootfs], "ed-live", egress=ONLY_NAMES), tmp_path / "hib", reuse=inst
        )
        await wait_http(again)
        assert await names(again) == ONLY_ALLOWED
        # Back to open: the proxy goes, everything answers again.
        await runtime.set_egress(again, EgressPolicy())
        assert await names(again) == ALL_NAMES
        assert f"ext {A}" in await plain(again, A)
    finally:
        if child is not None:
            await runtime.destroy(child)
        await runtime.destroy(again if again is not None else inst)


async def test_the_nodes_own_networks_stay_closed(runtime: GVisorRuntime, rootfs: Path) -> None:
    assert ipaddress.IPv4Network(f"{LAN_HOST}/{LAN_PLEN}", strict=False) in (
        runtime.network.own_networks
    )
    # Sanity: the LAN answers the host.
    assert b"lan" in await asyncio.to_thread(host_nc, LAN_PEER, 8080)
    everything = EgressPolicy(allow_out=["0.0.0.0/0", "lan.test", "allowed.test"])
    for policy in (None, everything):
        inst = await start(runtime, rootfs, "ed-lan", policy)
        try:
            assert "lan" not in await plain(inst, LAN_PEER, 8080)
            assert "lan" not in await sh(inst, http_cmd(LAN_PEER, "lan.test") + "; true")
            assert "lan" not in await sh(inst, http_cmd(LAN_PEER, "allowed.test") + "; true")
            # The fake internet, routed through a point-to-point link, is not the LAN.
            assert f"ext {A}" in await plain(inst, A)
            assert await http(inst, A, "allowed.test")
            # Metadata and loopback through the proxy: never.
            for ip in ("169.254.169.254", "127.0.0.1"):
                assert "HTTP/1" not in await sh(inst, http_cmd(ip, "allowed.test") + "; true")
        finally:
            await runtime.destroy(inst)
