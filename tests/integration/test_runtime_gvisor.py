"""The gVisor backend against the real thing: runsc, network namespaces, iptables, overlayfs.

Needs root, runsc (20240729+) and busybox-static. Uses its own net prefix/range and a temporary
AENV_HOME, and removes everything it made (by prefix and root dir) even when a test fails.
The sandboxes run busybox: `httpd` on port 49983 serving `/` (so GET /tmp/counter reads a file),
a CGI `/cgi-bin/run` that runs the POSTed shell command, and a counter loop in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import stat
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from aenv.config import Settings
from aenv.errors import RuntimeFailure
from aenv.runtime.base import Instance, SandboxSpec
from aenv.runtime.gvisor import GVisorRuntime
from aenv.runtime.gvisor.container import Container
from aenv.runtime.net.network import SlotAddressing
from aenv.runtime.rootfs import mount_points
from tests import netplan
from tests.helpers import async_wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("runsc") is None or not Path("/bin/busybox").exists(),
        reason="needs root, runsc and busybox-static",
    ),
]

PREFIX, CIDR = netplan.slot_net("rgv").prefix, netplan.slot_net("rgv").cidr
RECONCILE_PREFIX, RECONCILE_CIDR = netplan.slot_net("rrc").prefix, netplan.slot_net("rrc").cidr
EXT_NS, EXT_IF = netplan.name("ext"), netplan.name("ext0")
EXT_HOST, EXT_PEER = netplan.link(1).host, netplan.link(1).peer
PORT = 49983
MiB = 1024 * 1024

INIT = [
    "/bin/sh",
    "-c",
    "i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done & "
    f"exec httpd -f -p {PORT} -h /",
]
CGI = """#!/bin/sh
echo "Content-Type: text/plain"
echo ""
sh -c "$(head -c "$CONTENT_LENGTH")" 2>&1
"""

TIMINGS: dict[str, list[float]] = {}


def timed(name: str, seconds: float) -> None:
    TIMINGS.setdefault(name, []).append(seconds * 1000)


# Rootfs and layers --------------------------------------------------------------------------


def make_rootfs(dest: Path) -> Path:
    for d in ("bin", "etc", "www", "tmp", "proc", "sys", "dev", "root", "cgi-bin"):
        (dest / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2("/bin/busybox", dest / "bin" / "busybox")
    names = subprocess.run(
        ["/bin/busybox", "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    for name in names:
        if name != "busybox":
            (dest / "bin" / name).symlink_to("busybox")
    (dest / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (dest / "etc" / "group").write_text("root:x:0:\n")
    (dest / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    (dest / "www" / "index.html").write_text("hello from aenv\n")
    cgi = dest / "cgi-bin" / "run"
    cgi.write_text(CGI)
    cgi.chmod(0o755)
    (dest / "tmp").chmod(0o1777)
    return dest


def tree_digest(root: Path) -> dict[str, tuple[int, int]]:
    """Path -> (size, mtime_ns) of every entry, to prove a layer was not written."""
    out = {}
    for p in root.rglob("*"):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_rootfs(tmp_path_factory.mktemp("layer-base"))


@pytest.fixture(scope="module")
def upper_layer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("layer-upper")
    (d / "www").mkdir()
    (d / "www" / "extra.html").write_text("from the upper layer\n")
    (d / "etc").mkdir()
    (d / "etc" / "layer-marker").write_text("upper\n")
    return d


def rec(inst: Instance) -> Container:
    """The gVisor record behind a handle (its slot, bundle dir, rootfs key...)."""
    return Container.of(inst)


def spec(layers: list[Path], sandbox_id: str, **kw: object) -> SandboxSpec:
    s = SandboxSpec(sandbox_id=sandbox_id, layers=layers, args=INIT, memory_mb=256, cpu_count=1)
    for k, v in kw.items():
        setattr(s, k, v)
    return s


# Host inspection and cleanup -----------------------------------------------------------------


def host_traces(settings: Settings) -> dict[str, list[str]]:
    """Everything of this prefix/home still on the host."""
    addr = SlotAddressing.from_settings(settings)
    netns = (
        sorted(n for n in os.listdir("/run/netns") if addr.parse_netns(n) is not None)
        if Path("/run/netns").is_dir()
        else []
    )
    links = sorted(n for n in os.listdir("/sys/class/net") if addr.parse_host_if(n) is not None)
    rules = subprocess.run(
        "iptables -S; iptables -t nat -S", shell=True, capture_output=True, text=True
    ).stdout
    chains = sorted({line for line in rules.splitlines() if f"{settings.net_prefix}-" in line})
    containers = []
    if settings.runsc_root.is_dir():
        out = subprocess.run(
            ["runsc", f"--root={settings.runsc_root}", "list", "--format=json"],
            capture_output=True,
            text=True,
        ).stdout
        containers = [c["id"] for c in json.loads(out or "null") or []]
    mounts = [str(p) for p in mount_points(settings.home)]
    cgroups = [
        str(p) for p in Path("/sys/fs/cgroup").glob(f"*/{settings.net_prefix}/*") if p.is_dir()
    ]
    return {
        "netns": netns,
        "links": links,
        "rules": chains,
        "containers": containers,
        "mounts": mounts,
        "cgroups": cgroups,
    }


def assert_no_traces(settings: Settings) -> None:
    traces = host_traces(settings)
    assert all(not v for v in traces.values()), traces


def slot_traces(settings: Settings, slot: int) -> list[str]:
    addr = SlotAddressing.from_settings(settings)
    names = []
    for ns in (addr.router_ns(slot), addr.inner_ns(slot)):
        if Path("/run/netns", ns).exists():
            names.append(ns)
    if Path("/sys/class/net", addr.host_if(slot)).exists():
        names.append(addr.host_if(slot))
    return names


def make_settings(home: Path, prefix: str, cidr: str, pool: int = 2) -> Settings:
    return Settings(home=home, net_prefix=prefix, net_cidr=cidr, net_pool_size=pool)


@contextlib.asynccontextmanager
async def started_runtime(home: Path, prefix: str, cidr: str) -> AsyncIterator[GVisorRuntime]:
    """A started runtime with a prefix of its own; all it made is purged, and checked gone."""
    settings = make_settings(home, prefix, cidr)
    rt = GVisorRuntime(settings)
    try:
        await rt.start(set())
        yield rt
    finally:
        await GVisorRuntime(settings).purge()
        assert_no_traces(settings)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GVisorRuntime]:
    async with started_runtime(tmp_path_factory.mktemp("aenv-home"), PREFIX, CIDR) as rt:
        yield rt
    if TIMINGS:
        print("\n\ngVisor runtime timings (ms):")
        for name, values in TIMINGS.items():
            vals = ", ".join(f"{v:.0f}" for v in values)
            print(f"  {name:<28} median {sorted(values)[len(values) // 2]:7.1f}   [{vals}]")


# Talking to sandboxes -------------------------------------------------------------------------


def client(timeout: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=timeout, trust_env=False)


async def get(inst: Instance, path: str = "/www/index.html", timeout: float = 2.0) -> str:
    async with client(timeout) as c:
        r = await c.get(f"http://{inst.address}:{PORT}{path}")
        r.raise_for_status()
        return r.text


async def _http_ok(address: str, timeout: float) -> bool:
    """One bare HTTP GET (no client object: cheap enough to poll many sandboxes at once)."""
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(address, PORT)
            writer.write(b"GET /www/index.html HTTP/1.0\r\n\r\n")
            await writer.drain()
            return b" 200 " in await reader.readline()
    except (OSError, TimeoutError):
        return False
    finally:
        if writer is not None:
            writer.close()


async def wait_http(inst: Instance, limit: float = 15.0) -> float:
    """Seconds until the sandbox's httpd answers."""
    t0 = time.perf_counter()
    while not await _http_ok(inst.address, 0.5):
        if time.perf_counter() - t0 > limit:
            raise TimeoutError(f"{inst.id} at {inst.address} does not answer")
        await asyncio.sleep(0.01)
    return time.perf_counter() - t0


async def sh(inst: Instance, cmd: str, timeout: float = 20.0) -> str:
    async with client(timeout) as c:
        r = await c.post(f"http://{inst.address}:{PORT}/cgi-bin/run", content=cmd)
        r.raise_for_status()
        return r.text


async def read_ints(inst: Instance, *paths: str) -> list[int]:
    """Counter files read in one go inside the sandbox. The shell rewrites them (truncate,
    then write), so a read may come up empty: retried."""
    for _ in range(50):
        out = (await sh(inst, f"cat {' '.join(paths)}")).split()
        if len(out) == len(paths) and all(v.isdigit() for v in out):
            return [int(v) for v in out]
        await asyncio.sleep(0.02)
    raise AssertionError(f"cannot read {paths}: {out}")


async def counter(inst: Instance) -> int:
    return (await read_ints(inst, "/tmp/counter"))[0]


async def counter_past(
    inst: Instance, above: int, read: Callable[[Instance], Awaitable[int]] = counter
) -> int:
    """Until the sandbox's counter (read by `read`) is past `above`: its processes run. The
    value."""

    async def past() -> int:
        n = await read(inst)
        return n if n > above else 0

    return await async_wait_until(past, 15, 0.05, f"{inst.id}'s counter to pass {above}")


async def pool_full(rt: GVisorRuntime) -> None:
    """Until the slot pool holds all the ready slots it keeps (none left to build)."""
    pool = rt.pool
    await async_wait_until(lambda: pool.ready >= pool.size, 60, 0.02, "the slot pool to fill")


async def probe(inst: Instance, targets: list[tuple[str, int]]) -> dict[tuple[str, int], bool]:
    """From inside the sandbox, in parallel: does an HTTP request to host:port get an answer?"""
    lines = []
    for host, port in targets:
        lines.append(
            f"( if printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {host} {port} 2>/dev/null"
            f" | grep -q 'HTTP/1'; then echo OPEN {host}:{port}; "
            f"else echo CLOSED {host}:{port}; fi ) &"
        )
    lines.append("wait")
    out = await sh(inst, "\n".join(lines))
    result = {}
    for host, port in targets:
        assert f"{host}:{port}" in out, out
        result[(host, port)] = f"OPEN {host}:{port}" in out
    return result


# Host-side servers for the isolation tests ---------------------------------------------------


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(reader.readline(), 2)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhost\n")
        await writer.drain()
    writer.close()


@pytest_asyncio.fixture(loop_scope="module")
async def host_servers() -> AsyncIterator[tuple[int, int]]:
    """(port of a server on 0.0.0.0, port of a server on 127.0.0.1)."""
    public = await asyncio.start_server(_serve, "0.0.0.0", 0)
    local = await asyncio.start_server(_serve, "127.0.0.1", 0)
    try:
        yield public.sockets[0].getsockname()[1], local.sockets[0].getsockname()[1]
    finally:
        public.close()
        local.close()


EXT_SERVER = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080)); s.listen(16)
while True:
    c, _ = s.accept()
    c.recv(1024); c.sendall(b"HTTP/1.0 200 OK\\r\\nContent-Length: 4\\r\\n\\r\\next\\n"); c.close()
"""


@pytest.fixture
def ext_server() -> Iterator[tuple[str, int]]:
    """An "internet" host in its own netns (egress positive control): (address, port)."""
    setup = f"""set -e
ip netns add {EXT_NS}
ip link add {EXT_IF} type veth peer name eth0 netns {EXT_NS}
ip addr add {EXT_HOST}/30 dev {EXT_IF}; ip link set {EXT_IF} up
ip -n {EXT_NS} addr add {EXT_PEER}/30 dev eth0
ip -n {EXT_NS} link set eth0 up; ip -n {EXT_NS} link set lo up
"""
    proc = None
    try:
        subprocess.run(["sh", "-c", setup], check=True)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", EXT_NS, "python3", "-c", EXT_SERVER],
            stdin=subprocess.DEVNULL,
        )
        for _ in range(100):
            r = subprocess.run(
                ["sh", "-c", f"echo | busybox nc -w 1 {EXT_PEER} 8080"], capture_output=True
            )
            if b"HTTP/1.0" in r.stdout:
                break
            time.sleep(0.05)
        yield EXT_PEER, 8080
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "link", "del", EXT_IF], capture_output=True)
        subprocess.run(["ip", "netns", "del", EXT_NS], capture_output=True)


def host_nc(ip: str, port: int) -> bytes:
    cmd = f"printf 'GET /\\r\\n' | busybox nc -w 1 {ip} {port}"
    return subprocess.run(["sh", "-c", cmd], capture_output=True).stdout


def cgroups_of(cid: str) -> list[Path]:
    return list(Path("/sys/fs/cgroup").glob(f"*/{PREFIX}/{cid}"))


def top_level_entries(root: Path) -> list[Path]:
    return list(root.iterdir())


def host_addresses() -> list[str]:
    data = json.loads(subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True).stdout)
    return [
        a["local"]
        for link in data
        for a in link.get("addr_info", [])
        if not link["ifname"].startswith(PREFIX) and a["local"] != "127.0.0.1"
    ]


# Tests ------------------------------------------------------------------------------------------


async def test_create_serves_http(runtime: GVisorRuntime, rootfs: Path) -> None:
    await pool_full(runtime)  # this measures a pooled acquire
    t0 = time.perf_counter()
    inst = await runtime.create(spec([rootfs], "http1", hostname="box1"))
    timed("create (pooled slot)", time.perf_counter() - t0)
    try:
        timed("create -> HTTP answers", time.perf_counter() - t0)
        TIMINGS["create -> HTTP answers"][-1] += await wait_http(inst) * 1000
        assert inst.address == SlotAddressing(PREFIX, CIDR).router_ip(rec(inst).slot)
        assert "hello from aenv" in await get(inst)
        assert await runtime.alive(inst)
        out = await sh(inst, "ifconfig eth0; hostname; id -u")
        assert "169.254.0.21" in out and "box1" in out
        stats = await runtime.stats(inst)
        assert stats.mem_total_bytes == 256 * MiB
        assert 0 < stats.mem_used_bytes < 256 * MiB
        assert stats.rss_bytes > 0
        assert 0 <= stats.cpu_used_pct <= 100
        # Every port is reachable: httpd on a second port started from inside.
        await sh(inst, "httpd -p 8081 -h /www")
        async with client(10) as c:
            r = await c.get(f"http://{inst.address}:8081/index.html")
            assert r.status_code == 200
    finally:
        await runtime.destroy(inst)


async def test_sandboxes_are_isolated_from_each_other(runtime: GVisorRuntime, rootfs: Path) -> None:
    a, b = await asyncio.gather(
        runtime.create(spec([rootfs], "iso-a")), runtime.create(spec([rootfs], "iso-b"))
    )
    try:
        await asyncio.gather(wait_http(a), wait_http(b))
        assert a.address != b.address and rec(a).slot != rec(b).slot
        await sh(a, "echo secret-a > /tmp/secret; echo rootfs-a > /etc/secret")
        out = await sh(b, "cat /tmp/secret /etc/secret; echo end")
        assert "secret-a" not in out and "rootfs-a" not in out
        addr = SlotAddressing(PREFIX, CIDR)
        res = await probe(
            a,
            [
                ("127.0.0.1", PORT),  # its own httpd: the probe itself works
                (b.address, PORT),  # the other sandbox's address
                (addr.host_ip(rec(b).slot), PORT),  # the host side of the other's slot
            ],
        )
        assert res == {
            ("127.0.0.1", PORT): True,
            (b.address, PORT): False,
            (addr.host_ip(rec(b).slot), PORT): False,
        }
        # The node still reaches both.
        assert "hello" in await get(a) and "hello" in await get(b)
    finally:
        await asyncio.gather(runtime.destroy(a), runtime.destroy(b))


async def test_sandbox_cannot_reach_host_services(
    runtime: GVisorRuntime,
    rootfs: Path,
    host_servers: tuple[int, int],
    ext_server: tuple[str, int],
) -> None:
    public_port, local_port = host_servers
    inst = await runtime.create(spec([rootfs], "iso-host"))
    try:
        await wait_http(inst)
        addr = SlotAddressing(PREFIX, CIDR)
        own_host_ip = addr.host_ip(rec(inst).slot)
        targets = [(own_host_ip, public_port), (own_host_ip, local_port)]
        targets += [(ip, public_port) for ip in host_addresses()]
        targets += [("127.0.0.1", local_port), (ext_server[0], ext_server[1])]
        # Sanity: from the host, the 0.0.0.0 server answers on each of these addresses.
        for ip in [own_host_ip, *host_addresses()]:
            assert b"HTTP/1.0 200" in await asyncio.to_thread(host_nc, ip, public_port), ip
        res = await probe(inst, targets)
        assert res.pop(ext_server) is True, "egress to a non-host address must work"
        assert not any(res.values()), res
    finally:
        await runtime.destroy(inst)


async def test_freeze_thaw(runtime: GVisorRuntime, rootfs: Path) -> None:
    inst = await runtime.create(spec([rootfs], "freeze"))
    try:
        await wait_http(inst)
        before = await counter(inst)
        t0 = time.perf_counter()
        await runtime.freeze(inst)
        timed("freeze", time.perf_counter() - t0)
        assert await runtime.alive(inst)
        # No answer: usually a timeout; under heavy host load the sentry's netstack (which
        # keeps running while the tasks are paused) may also drop the connection.
        with pytest.raises((httpx.TimeoutException, httpx.RemoteProtocolError)):
            await get(inst, "/tmp/counter", timeout=0.5)
        t0 = time.perf_counter()
        await runtime.thaw(inst)
        timed("thaw", time.perf_counter() - t0)
        after = await counter(inst)
        assert after >= before
        await counter_past(inst, after)  # it goes on
    finally:
        await runtime.destroy(inst)


async def test_checkpoint_and_fork(runtime: GVisorRuntime, rootfs: Path, tmp_path: Path) -> None:
    before_layer = tree_digest(rootfs)
    parent = await runtime.create(spec([rootfs], "fork-p"))
    children: list[Instance] = []
    try:
        await wait_http(parent)
        await sh(parent, "echo before > /tmp/marker; echo rootfs > /etc/marker")
        # The counter has run a while: a child that started it again from 0 would be behind.
        await counter_past(parent, 10)
        image = tmp_path / "image"
        t0 = time.perf_counter()
        await runtime.checkpoint(parent, image, leave_running=True)
        timed("checkpoint --leave-running", time.perf_counter() - t0)
        at_checkpoint = await counter(parent)
        assert any(image.iterdir())
        for i in range(2):
            t0 = time.perf_counter()
            child = await runtime.restore(spec([rootfs], f"fork-c{i}"), image)
            timed("restore", time.perf_counter() - t0)
            children.append(child)
            t1 = time.perf_counter()
            await wait_http(child)
            timed("restore -> HTTP answers", time.perf_counter() - t0)
            timed("  (HTTP wait after restore)", time.perf_counter() - t1)
        assert len({parent.address, *(c.address for c in children)}) == 3
        for child in children:
            out = await sh(child, "cat /tmp/marker /etc/marker")
            assert "before" in out and "rootfs" in out
            n = await counter(child)
            # Memory state came along: the counter goes on from the checkpoint, not from 0.
            assert n >= at_checkpoint - 5
        # Each continues on its own, and so does the parent.
        await sh(children[0], "echo only-c0 > /tmp/own")
        out = await sh(children[1], "cat /tmp/own; echo end")
        assert "only-c0" not in out
        assert "only-c0" not in await sh(parent, "cat /tmp/own; echo end")
        values = [await counter(x) for x in (parent, *children)]
        for x, value in zip((parent, *children), values, strict=True):
            await counter_past(x, value)
        # The layer directory was never written (writes live in the sentry's memory overlay).
        assert tree_digest(rootfs) == before_layer
        assert not any(p.name.startswith(".gvisor") for p in top_level_entries(rootfs))
    finally:
        await asyncio.gather(*(runtime.destroy(x) for x in (parent, *children)))


async def test_checkpoint_stops_sandbox_and_restores(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path
) -> None:
    """Hibernate: freeze, checkpoint without leave_running, restore later."""
    inst = await runtime.create(spec([rootfs], "hib"))
    child = None
    try:
        await wait_http(inst)
        await sh(inst, "echo kept > /tmp/kept")
        await runtime.freeze(inst)
        t0 = time.perf_counter()
        await runtime.checkpoint(inst, tmp_path / "img", leave_running=False)
        timed("checkpoint (stops)", time.perf_counter() - t0)
        assert not await runtime.alive(inst)
        await runtime.destroy(inst)
        t0 = time.perf_counter()
        child = await runtime.restore(spec([rootfs], "hib"), tmp_path / "img")
        timed("restore (of hibernated)", time.perf_counter() - t0)
        # Restored as it was: paused. Thaw it.
        if not await _answers(child):
            await runtime.thaw(child)
        await wait_http(child)
        assert "kept" in await sh(child, "cat /tmp/kept")
    finally:
        await runtime.destroy(inst)
        if child is not None:
            await runtime.destroy(child)


async def _answers(inst: Instance) -> bool:
    try:
        await get(inst, timeout=1.0)
        return True
    except httpx.HTTPError:
        return False


async def test_destroy_leaves_nothing(
    runtime: GVisorRuntime, rootfs: Path, upper_layer: Path
) -> None:
    settings = runtime.settings
    inst = await runtime.create(spec([upper_layer, rootfs], "gone"))
    await wait_http(inst)
    key = rec(inst).rootfs_key
    assert key and (settings.home / "mnt" / key) in mount_points(settings.home)
    t0 = time.perf_counter()
    await runtime.destroy(inst)
    timed("destroy (awaited part)", time.perf_counter() - t0)
    assert not await runtime.alive(inst)
    t0 = time.perf_counter()
    await runtime.wait_idle()
    timed("destroy (background part)", time.perf_counter() - t0)
    await runtime.destroy(inst)  # idempotent
    await runtime.wait_idle()
    assert slot_traces(settings, rec(inst).slot) == [] or rec(inst).slot in _pool_slots(runtime)
    assert inst.id not in host_traces(settings)["containers"]
    assert not rec(inst).bundle_dir.exists()
    assert (settings.home / "mnt" / key) not in mount_points(settings.home)
    assert not cgroups_of(inst.id)


def _pool_slots(rt: GVisorRuntime) -> set[int]:
    return {s.index for s in rt.pool._ready}


async def test_layer_stack_is_shared_and_read_only(
    runtime: GVisorRuntime, rootfs: Path, upper_layer: Path
) -> None:
    settings = runtime.settings
    before = (tree_digest(rootfs), tree_digest(upper_layer))
    a, b = await asyncio.gather(
        runtime.create(spec([upper_layer, rootfs], "ml-a")),
        runtime.create(spec([upper_layer, rootfs], "ml-b")),
    )
    try:
        await asyncio.gather(wait_http(a), wait_http(b))
        key = rec(a).rootfs_key
        assert key is not None and key == rec(b).rootfs_key
        mnt = settings.home / "mnt" / key
        assert mount_points(settings.home).count(mnt) == 1
        assert "upper layer" in await get(a, "/www/extra.html")
        assert "hello" in await get(a, "/www/index.html")
        await sh(a, "echo changed > /www/extra.html; rm /etc/passwd; echo new > /newfile")
        assert "changed" in await get(a, "/www/extra.html")
        assert "upper layer" in await get(b, "/www/extra.html")
        assert "root:x" in await sh(b, "cat /etc/passwd")
        assert (tree_digest(rootfs), tree_digest(upper_layer)) == before
        await runtime.destroy(a)
        await runtime.wait_idle()
        assert mnt in mount_points(settings.home)  # b still uses it
        assert "upper layer" in await get(b, "/www/extra.html")
    finally:
        await asyncio.gather(runtime.destroy(a), runtime.destroy(b))
    await runtime.wait_idle()
    assert mnt not in mount_points(settings.home)


async def test_cgroup_limits(runtime: GVisorRuntime, rootfs: Path) -> None:
    inst = await runtime.create(spec([rootfs], "limits", cpu_count=1, memory_mb=128))
    other = await runtime.create(spec([rootfs], "bystander"))
    try:
        await asyncio.gather(wait_http(inst), wait_http(other))
        cg = f"{PREFIX}/{inst.id}"
        mem = Path("/sys/fs/cgroup/memory", cg)
        cpu = Path("/sys/fs/cgroup/cpu", cg)
        assert int((mem / "memory.limit_in_bytes").read_text()) == 128 * MiB
        assert int((cpu / "cpu.cfs_quota_us").read_text()) == 100_000
        assert int((cpu / "cpu.cfs_period_us").read_text()) == 100_000
        out = (await sh(inst, "nproc; free -m | grep Mem")).split()
        # runsc --cpu-num-from-quota: ceil(quota), but never below 2.
        assert int(out[0]) == max(2, min(1, os.cpu_count() or 1))
        assert 120 <= int(out[2]) <= 128, out
        # A memory hog: the sandbox is OOM-killed inside its own cgroup, nothing else is.
        with contextlib.suppress(httpx.HTTPError):
            await sh(inst, "dd if=/dev/zero of=/tmp/big bs=1M count=400", timeout=30)
        for _ in range(100):
            if not await runtime.alive(inst):
                break
            await asyncio.sleep(0.1)
        assert not await runtime.alive(inst)
        oom = dict(line.split() for line in (mem / "memory.oom_control").read_text().splitlines())
        assert int(oom["oom_kill"]) >= 1
        assert await runtime.alive(other) and "hello" in await get(other)
    finally:
        await asyncio.gather(runtime.destroy(inst), runtime.destroy(other))


async def test_slot_pool(runtime: GVisorRuntime) -> None:
    pool = runtime.pool
    await pool_full(runtime)
    assert pool.ready == pool.size
    t0 = time.perf_counter()
    slot = await pool.acquire()
    timed("slot acquire (pooled)", time.perf_counter() - t0)
    await pool.release(slot)
    t0 = time.perf_counter()
    n = runtime.addressing.capacity - 1  # the last slot: the longest names, the last addresses
    built = await runtime.network.build(n)
    timed("slot setup (build)", time.perf_counter() - t0)
    try:
        assert built.router_ip == SlotAddressing(PREFIX, CIDR).router_ip(n)
        cmd = ["ip", "-n", built.inner_ns, "-j", "addr", "show", "eth0"]
        r = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True)
        assert "169.254.0.21" in r.stdout
    finally:
        t0 = time.perf_counter()
        await runtime.network.teardown(n)
        timed("slot teardown", time.perf_counter() - t0)
    assert slot_traces(runtime.settings, n) == []


async def test_failed_create_and_restore_leave_nothing(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path
) -> None:
    settings = runtime.settings
    await runtime.wait_idle()
    before = host_traces(settings)
    with pytest.raises(RuntimeFailure, match="no-such-binary"):
        await runtime.create(
            SandboxSpec(sandbox_id="bad", layers=[rootfs], args=["/no-such-binary"])
        )
    (tmp_path / "empty-image").mkdir()
    with pytest.raises(RuntimeFailure):
        await runtime.restore(spec([rootfs], "bad2"), tmp_path / "empty-image")
    with pytest.raises(RuntimeFailure):
        await runtime.restore(spec([rootfs], "bad3"), tmp_path / "missing")
    await runtime.wait_idle()
    await pool_full(runtime)  # it refilled what was taken: no slot half-built
    after = host_traces(settings)
    assert after["containers"] == before["containers"] == []
    assert not (settings.sandboxes_dir / "bad").exists()
    assert set(after["netns"]) <= set(before["netns"]) | {
        ns for s in runtime.pool._ready for ns in (s.router_ns, s.inner_ns)
    }


async def test_concurrent_creates(runtime: GVisorRuntime, rootfs: Path) -> None:
    t0 = time.perf_counter()
    insts = await asyncio.gather(*(runtime.create(spec([rootfs], f"many{i}")) for i in range(4)))
    try:
        await asyncio.gather(*(wait_http(i) for i in insts))
        timed("4 concurrent creates -> HTTP", time.perf_counter() - t0)
        assert len({i.address for i in insts}) == 4
        assert len({rec(i).slot for i in insts}) == 4
    finally:
        await asyncio.gather(*(runtime.destroy(i) for i in insts))


# Writable host overlays (spec.upper), stop and re-stack --------------------------------------

# The counter goes to the rootfs (/root/counter) and to /tmp (/tmp/counter): both land in the
# host upper dir (/tmp is the rootfs's own, bound over /tmp).
INIT_RW = [
    "/bin/sh",
    "-c",
    "i=0; while :; do i=$((i+1)); echo $i > /root/counter; echo $i > /tmp/counter; "
    "sleep 0.1; done & "
    f"exec httpd -f -p {PORT} -h /",
]


def write_random(mib: int) -> str:
    """A shell command writing `mib` MiB of incompressible, non-zero data to /root/big in one
    process (gVisor skips zero pages when it saves memory, and every process a sandbox has
    run adds to its checkpoint state, so neither would show what the rootfs costs)."""
    return f"dd if=/dev/urandom of=/root/big bs=1M count={mib} iflag=fullblock 2>/dev/null"


def rw_spec(layers: list[Path], sandbox_id: str, upper: Path, **kw: object) -> SandboxSpec:
    return spec(layers, sandbox_id, args=INIT_RW, upper=upper, **kw)


def new_upper(root: Path, name: str) -> Path:
    d = root / "uppers" / name
    d.mkdir(parents=True)
    return d


async def root_counter(inst: Instance) -> int:
    return (await read_ints(inst, "/root/counter"))[0]


def host_counter(upper: Path, *, wait: bool = True) -> int:
    """The counter file as the host sees it in an upper dir. The shell rewrites it (truncate,
    then write), so a read can come up empty: retried while the sandbox runs, 0 when it does
    not (a checkpoint between the two steps)."""
    path = upper / "root" / "counter"
    deadline = time.monotonic() + 2
    while True:
        text = path.read_text().strip()
        if text or not wait or time.monotonic() > deadline:
            return int(text or 0)
        time.sleep(0.01)


def work_dirs(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("work-*"))


def file_mib(path: Path) -> float:
    return path.stat().st_size / MiB


async def test_upper_overlay_writes_land_in_upper(
    runtime: GVisorRuntime, rootfs: Path, upper_layer: Path, tmp_path: Path
) -> None:
    before = (tree_digest(rootfs), tree_digest(upper_layer))
    upper = new_upper(tmp_path, "u")
    inst = await runtime.create(rw_spec([upper_layer, rootfs], "rw", upper))
    try:
        await wait_http(inst)
        mnt = rec(inst).bundle_dir / "rootfs"
        assert mnt in mount_points(runtime.settings.home)
        assert (tmp_path / "uppers" / f"work-{inst.id}").is_dir()
        assert rec(inst).overlay == "none"
        await sh(
            inst,
            "dd if=/dev/zero of=/root/big bs=1M count=32 2>/dev/null; echo new > /newfile; "
            "rm /etc/hosts /etc/layer-marker; rm -rf /www; mkdir /www; "
            "echo x > /www/y; echo t > /tmp/in-tmp",
        )
        assert file_mib(upper / "root" / "big") == 32
        assert (upper / "newfile").read_text() == "new\n"
        # Deleted lower files: overlayfs whiteouts (0/0 character devices).
        for gone in (upper / "etc" / "hosts", upper / "etc" / "layer-marker"):
            st = gone.lstat()
            assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(0, 0), gone
        # A directory replaced by a new one: opaque.
        assert os.getxattr(upper / "www", "trusted.overlay.opaque") == b"y"
        assert sorted(p.name for p in (upper / "www").iterdir()) == ["y"]
        # /tmp is the rootfs's own (not runsc's in-memory tmpfs): in the upper dir too.
        assert (upper / "tmp" / "in-tmp").read_text() == "t\n"
        assert "t" in await sh(inst, "cat /tmp/in-tmp")
        assert (tree_digest(rootfs), tree_digest(upper_layer)) == before
    finally:
        await runtime.destroy(inst)
    await runtime.wait_idle()
    assert mnt not in mount_points(runtime.settings.home)
    assert work_dirs(tmp_path) == []
    assert not rec(inst).bundle_dir.exists()
    # The upper dir belongs to the caller: kept, with its content.
    assert file_mib(upper / "root" / "big") == 32


async def test_tmp_in_upper_when_image_tmp_is_not_empty(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path
) -> None:
    """A file in the image's /tmp stays visible, and new ones land in the upper dir."""
    layer = tmp_path / "keep-tmp"
    (layer / "tmp").mkdir(parents=True)
    (layer / "tmp" / ".keep").write_text("")
    upper = new_upper(tmp_path, "u")
    inst = await runtime.create(rw_spec([layer, rootfs], "rwtmp", upper))
    try:
        await wait_http(inst)
        await sh(inst, "echo t > /tmp/in-tmp")
        assert (upper / "tmp" / "in-tmp").read_text() == "t\n"
        assert "keep" in await sh(inst, "ls -a /tmp")
    finally:
        await runtime.destroy(inst)


async def _restack(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path, big_mb: int, tag: str
) -> None:
    """The re-stack flow the orchestrator drives for a snapshot with a host upper dir:
    checkpoint (stops) -> stop -> seal U0 into layer S -> restore the parent on [S, *old] with
    a new upper, in its own slot -> fork children from the same image."""
    old = [rootfs]
    u0 = new_upper(tmp_path, "u0")
    parent = await runtime.create(rw_spec(old, f"rs{tag}", u0, memory_mb=512))
    children: list[Instance] = []
    restored: Instance | None = None
    try:
        await wait_http(parent)
        t0 = time.perf_counter()
        await sh(parent, write_random(big_mb), 300)
        timed(f"restack {tag}: write {big_mb} MiB", time.perf_counter() - t0)
        await sh(parent, "echo parent > /etc/marker; rm /etc/hosts; echo t > /tmp/in-tmp")
        assert file_mib(u0 / "root" / "big") == big_mb
        # The counter has run a while: a restore that started it again would be behind.
        await counter_past(parent, 10)
        image = tmp_path / "image"
        slot, cid, address = rec(parent).slot, parent.id, parent.address

        t0 = time.perf_counter()
        await runtime.checkpoint(parent, image, leave_running=False)
        t1 = time.perf_counter()
        await runtime.stop(parent)
        t2 = time.perf_counter()
        assert runtime.is_stopped(parent) and not await runtime.alive(parent)
        assert rec(parent).bundle_dir / "rootfs" not in mount_points(runtime.settings.home)
        assert work_dirs(tmp_path) == []
        assert slot_traces(runtime.settings, slot) != []  # the slot is kept
        at_checkpoint = host_counter(u0, wait=False)
        # The orchestrator seals U0: a rename into a read-only layer, whatever its size.
        sealed = tmp_path / "layers" / "s1"
        sealed.parent.mkdir()
        os.rename(u0, sealed)
        t3 = time.perf_counter()
        sealed_digest = tree_digest(sealed)
        layers = [sealed, *old]
        u1 = new_upper(tmp_path, "u1")
        restored = await runtime.restore(rw_spec(layers, f"rs{tag}", u1), image, reuse=parent)
        t4 = time.perf_counter()
        await wait_http(restored)
        t5 = time.perf_counter()
        timed(f"restack {tag}: checkpoint (stops)", t1 - t0)
        timed(f"restack {tag}: stop", t2 - t1)
        timed(f"restack {tag}: seal (rename)", t3 - t2)
        timed(f"restack {tag}: restore (reuse)", t4 - t3)
        timed(f"restack {tag}: HTTP after restore", t5 - t4)
        timed(f"restack {tag}: parent downtime", t5 - t0)
        TIMINGS.setdefault(f"restack {tag}: image MiB", []).append(dir_mib(image))

        # Same sandbox, same place: address and slot. The container id is new: the old
        # container's `runsc delete` was left out of the stop and happens now, in the
        # background.
        assert (restored.address, rec(restored).slot) == (address, slot)
        assert restored.id != cid and restored.id.startswith(f"rs{tag}-")
        deadline = time.monotonic() + 30
        while runtime.runsc.sandbox_state_file(cid) is not None:
            assert time.monotonic() < deadline, "the old container was never deleted"
            await asyncio.sleep(0.1)
        # Both counters in one read, from the sealed layer + new upper; the process went on
        # from where it was.
        n, in_tmp = await read_ints(restored, "/root/counter", "/tmp/counter")
        assert n >= at_checkpoint, (n, at_checkpoint)
        assert abs(in_tmp - n) <= 1, (in_tmp, n)
        out = await sh(restored, "ls -l /root/big; cat /etc/marker /tmp/in-tmp; cat /etc/hosts")
        assert str(big_mb * MiB) in out and "parent" in out and "t\n" in out
        assert "No such file" in out  # the whiteout in the sealed layer still hides it
        await counter_past(restored, n, root_counter)
        # New writes (the counter) go to the new upper, not to the sealed layer.
        assert host_counter(u1) > at_checkpoint
        assert not (u1 / "root" / "big").exists()

        # Fork: children from the same image, each on its own upper over the same stack.
        t0 = time.perf_counter()
        uppers = [new_upper(tmp_path, f"c{i}") for i in range(2)]
        children = list(
            await asyncio.gather(
                *(
                    runtime.restore(rw_spec(layers, f"rs{tag}-c{i}", u), image)
                    for i, u in enumerate(uppers)
                )
            )
        )
        await asyncio.gather(*(wait_http(c) for c in children))
        timed(f"restack {tag}: 2 children -> HTTP", time.perf_counter() - t0)
        assert len({restored.address, *(c.address for c in children)}) == 3
        for i, c in enumerate(children):
            assert await root_counter(c) >= at_checkpoint
            await sh(c, f"echo only-c{i} > /root/own")
            assert (uppers[i] / "root" / "own").read_text() == f"only-c{i}\n"
        # A file written in one is visible neither in the other nor in the parent.
        assert "only-c1" not in await sh(children[0], "cat /root/own")
        assert "only-c0" not in await sh(children[1], "cat /root/own")
        assert "only-c" not in await sh(restored, "cat /root/own 2>&1; echo end")
        values = [await root_counter(x) for x in (restored, *children)]
        for x, value in zip((restored, *children), values, strict=True):
            await counter_past(x, value, root_counter)
        assert tree_digest(sealed) == sealed_digest  # the sealed layer is never written
    finally:
        await asyncio.gather(
            *(runtime.destroy(x) for x in (parent, restored, *children) if x is not None)
        )
    await runtime.wait_idle()
    assert mount_points(runtime.settings.sandboxes_dir) == []
    assert work_dirs(tmp_path) == []
    assert slot_traces(runtime.settings, slot) == [] or slot in _pool_slots(runtime)


def dir_mib(path: Path) -> float:
    """Size of the files below `path` (apparent size: an image file may be sparse)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / MiB


async def test_restack_fork(runtime: GVisorRuntime, rootfs: Path, tmp_path: Path) -> None:
    await _restack(runtime, rootfs, tmp_path, big_mb=64, tag="64M")


@pytest.mark.skipif(not os.environ.get("AENV_RUNTIME_BENCH"), reason="AENV_RUNTIME_BENCH=1")
async def test_restack_fork_1gib(runtime: GVisorRuntime, rootfs: Path, tmp_path: Path) -> None:
    """The seal is a rename and the image does not carry the rootfs: neither grows."""
    await _restack(runtime, rootfs, tmp_path, big_mb=1024, tag="1G")


@pytest.mark.skipif(not os.environ.get("AENV_RUNTIME_BENCH"), reason="AENV_RUNTIME_BENCH=1")
async def test_memory_overlay_1gib_for_comparison(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path
) -> None:
    """The same 1 GiB written with --overlay2=root:memory: it is in every checkpoint."""
    inst = await runtime.create(spec([rootfs], "mem1g", args=INIT_RW, memory_mb=2048))
    child = None
    try:
        await wait_http(inst)
        await sh(inst, write_random(1024), 300)
        image = tmp_path / "image"
        t0 = time.perf_counter()
        await runtime.checkpoint(inst, image, leave_running=False)
        t1 = time.perf_counter()
        await runtime.stop(inst)
        t2 = time.perf_counter()
        child = await runtime.restore(
            spec([rootfs], "mem1g", args=INIT_RW, memory_mb=2048), image, reuse=inst
        )
        t3 = time.perf_counter()
        await wait_http(child)
        t4 = time.perf_counter()
        assert str(1024 * MiB) in await sh(child, "ls -l /root/big")
        timed("root:memory 1G: checkpoint (stops)", t1 - t0)
        timed("root:memory 1G: stop", t2 - t1)
        timed("root:memory 1G: restore (reuse)", t3 - t2)
        timed("root:memory 1G: HTTP after restore", t4 - t3)
        timed("root:memory 1G: downtime", t4 - t0)
        TIMINGS.setdefault("root:memory 1G: image MiB", []).append(dir_mib(image))
    finally:
        await runtime.destroy(inst)
        if child is not None:
            await runtime.destroy(child)


async def test_stop_running_keeps_files_and_address(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path
) -> None:
    """Pause without memory: stop a running sandbox (processes dropped, files kept), then
    boot it again in the same slot on the same upper."""
    upper = new_upper(tmp_path, "u")
    inst = await runtime.create(rw_spec([rootfs], "nomem", upper))
    again = None
    try:
        await wait_http(inst)
        await sh(inst, "echo kept > /root/kept; echo gone > /tmp/gone")
        t0 = time.perf_counter()
        await runtime.stop(inst)
        timed("stop (running, kill)", time.perf_counter() - t0)
        await runtime.stop(inst)  # idempotent
        assert runtime.is_stopped(inst)
        with pytest.raises(RuntimeFailure):
            await runtime.freeze(inst)
        with pytest.raises(RuntimeFailure, match="belongs to sandbox"):
            await runtime.create(rw_spec([rootfs], "other", new_upper(tmp_path, "x")), reuse=inst)
        t0 = time.perf_counter()
        again = await runtime.create(rw_spec([rootfs], "nomem", upper), reuse=inst)
        await wait_http(again)
        timed("create (reuse) -> HTTP", time.perf_counter() - t0)
        assert (again.address, again.id) == (inst.address, inst.id)
        # Files kept, /tmp's too (it is the rootfs's own); memory not: a fresh boot.
        out = await sh(again, "cat /root/kept; cat /tmp/gone 2>&1")
        assert out.split() == ["kept", "gone"]
        # An image that looks whole, so that the refusal is about `reuse`.
        (tmp_path / "img").mkdir()
        (tmp_path / "img" / "checkpoint.img").write_bytes(b"x")
        with pytest.raises(RuntimeFailure, match="not a stopped"):
            await runtime.restore(rw_spec([rootfs], "nomem", upper), tmp_path / "img", reuse=again)
    finally:
        await runtime.destroy(again or inst)
    await runtime.wait_idle()
    assert slot_traces(runtime.settings, rec(inst).slot) == [] or rec(inst).slot in _pool_slots(
        runtime
    )
    assert mount_points(runtime.settings.sandboxes_dir) == []
    assert (upper / "root" / "kept").exists()


async def test_stopped_destroy_releases_slot(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path
) -> None:
    upper = new_upper(tmp_path, "u")
    inst = await runtime.create(rw_spec([rootfs], "stopdel", upper))
    await wait_http(inst)
    await runtime.checkpoint(inst, tmp_path / "img", leave_running=False)
    await runtime.stop(inst)
    assert slot_traces(runtime.settings, rec(inst).slot) != []
    assert rec(inst).bundle_dir.is_dir()
    await runtime.destroy(inst)
    await runtime.wait_idle()
    assert slot_traces(runtime.settings, rec(inst).slot) == [] or rec(inst).slot in _pool_slots(
        runtime
    )
    assert not rec(inst).bundle_dir.exists()
    assert inst.id not in host_traces(runtime.settings)["containers"]


async def test_failed_restore_keeps_stopped_slot(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path
) -> None:
    upper = new_upper(tmp_path, "u")
    inst = await runtime.create(rw_spec([rootfs], "refail", upper))
    try:
        await wait_http(inst)
        await runtime.checkpoint(inst, tmp_path / "img", leave_running=False)
        await runtime.stop(inst)
        (tmp_path / "bad-image").mkdir()
        u1 = new_upper(tmp_path, "u1")
        with pytest.raises(RuntimeFailure):
            await runtime.restore(
                rw_spec([rootfs], "refail", u1), tmp_path / "bad-image", reuse=inst
            )
        await runtime.wait_idle()
        # Still stopped, slot kept, nothing mounted: the caller can retry.
        assert runtime.is_stopped(inst) and slot_traces(runtime.settings, rec(inst).slot) != []
        assert mount_points(runtime.settings.sandboxes_dir) == []
        assert work_dirs(tmp_path) == []
        sealed = tmp_path / "s1"
        os.rename(upper, sealed)
        again = await runtime.restore(
            rw_spec([sealed, rootfs], "refail", u1), tmp_path / "img", reuse=inst
        )
        await wait_http(again)
        assert again.address == inst.address
        inst = again
    finally:
        await runtime.destroy(inst)


async def test_reuse_falls_back_to_a_new_container_id(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the stopped container's id is not free (its delete failed), the sandbox starts
    under a new id, still in its own slot (same address), and the old bundle goes."""
    upper = new_upper(tmp_path, "u")
    inst = await runtime.create(rw_spec([rootfs], "newid", upper))
    again = None
    try:
        await wait_http(inst)
        await runtime.stop(inst)
        real = runtime.runsc.sandbox_state_file
        taken = tmp_path / "taken.state"
        monkeypatch.setattr(
            runtime.runsc,
            "sandbox_state_file",
            lambda cid: taken if cid == inst.id else real(cid),
        )
        again = await runtime.create(rw_spec([rootfs], "newid", upper), reuse=inst)
        await wait_http(again)
        assert again.id != inst.id
        assert (again.address, rec(again).slot) == (inst.address, rec(inst).slot)
        await runtime.wait_idle()
        assert not rec(inst).bundle_dir.exists() and rec(again).bundle_dir.is_dir()
    finally:
        monkeypatch.undo()
        await runtime.destroy(again or inst)
    await runtime.wait_idle()
    assert mount_points(runtime.settings.sandboxes_dir) == []


async def _restore_many(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path, image: Path, n: int, tag: str
) -> None:
    uppers = [new_upper(tmp_path, f"{tag}-{n}-{i}") for i in range(n)]
    t0 = time.perf_counter()
    each: list[float] = []

    async def one(i: int) -> Instance:
        inst = await runtime.restore(rw_spec([rootfs], f"par{tag}{n}-{i}", uppers[i]), image)
        await wait_http(inst, limit=120)
        each.append(time.perf_counter() - t0)
        return inst

    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    insts = [r for r in results if isinstance(r, Instance)]
    try:
        assert len(insts) == n, [r for r in results if not isinstance(r, Instance)]
        timed(f"{n:>2} parallel restores -> all HTTP", time.perf_counter() - t0)
        timed(f"{n:>2} parallel restores: median child", sorted(each)[len(each) // 2])
    finally:
        await asyncio.gather(*(runtime.destroy(i) for i in insts))
        await runtime.wait_idle()


@pytest.mark.parametrize(
    "n",
    [
        1,
        4,
        pytest.param(
            16,
            marks=pytest.mark.skipif(
                not os.environ.get("AENV_RUNTIME_BENCH"), reason="AENV_RUNTIME_BENCH=1"
            ),
        ),
    ],
)
async def test_parallel_restores(
    runtime: GVisorRuntime, rootfs: Path, tmp_path: Path, n: int
) -> None:
    upper = new_upper(tmp_path, "parent")
    parent = await runtime.create(rw_spec([rootfs], f"parp{n}", upper))
    try:
        await wait_http(parent)
        await runtime.checkpoint(parent, tmp_path / "img", leave_running=True)
    finally:
        await runtime.destroy(parent)
    await runtime.wait_idle()
    await pool_full(runtime)
    await _restore_many(runtime, rootfs, tmp_path, tmp_path / "img", n, "p")


# Reconcile after a crash (own prefix, range and home) -----------------------------------------


def crash(rt: GVisorRuntime) -> None:
    """Drops a runtime like a killed process would: no cleanup, pool slots left behind."""
    for task in (rt.pool._task, rt.reaper.sweep._task):
        if task is not None:
            task.cancel()
    rt.pool._task = None
    rt.reaper.sweep._task = None


async def test_reconcile_after_crash(
    rootfs: Path, upper_layer: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    settings = make_settings(
        tmp_path_factory.mktemp("aenv-home-rc"), RECONCILE_PREFIX, RECONCILE_CIDR, pool=1
    )
    try:
        rt1 = GVisorRuntime(settings)
        await rt1.start(set())
        keep = await rt1.create(spec([upper_layer, rootfs], "rc-keep"))
        drop = await rt1.create(spec([rootfs], "rc-drop"))
        await asyncio.gather(wait_http(keep), wait_http(drop))
        await sh(keep, "echo state > /tmp/state")
        await pool_full(rt1)  # the crash leaves a ready pool slot behind
        crash(rt1)
        del rt1

        rt2 = GVisorRuntime(settings)
        recovered = await rt2.start({keep.id, "ghost-0000"})
        assert set(recovered) == {keep.id}
        back = recovered[keep.id]
        assert (back.address, rec(back).slot, rec(back).bundle_dir) == (
            keep.address,
            rec(keep).slot,
            rec(keep).bundle_dir,
        )
        assert await rt2.alive(back)
        assert "state" in await sh(back, "cat /tmp/state")
        assert not await rt2.alive(drop)
        await rt2.close()  # the pool's slots go; the recovered sandbox stays
        traces = host_traces(settings)
        assert traces["containers"] == [keep.id]
        addr = SlotAddressing.from_settings(settings)
        assert traces["netns"] == sorted(
            [addr.router_ns(rec(keep).slot), addr.inner_ns(rec(keep).slot)]
        )
        assert traces["links"] == [addr.host_if(rec(keep).slot)]
        assert not rec(drop).bundle_dir.exists() and rec(keep).bundle_dir.exists()
        mnt = settings.home / "mnt"
        assert traces["mounts"] == [str(mnt / str(rec(keep).rootfs_key))]
        crash(rt2)
        del rt2

        # Another crash, and now the catalog knows nothing: everything goes.
        rt3 = GVisorRuntime(settings)
        assert await rt3.start(set()) == {}
        await rt3.close()
        traces = host_traces(settings)
        for k in ("containers", "netns", "links", "mounts", "cgroups"):
            assert traces[k] == [], (k, traces)
        assert not any(settings.sandboxes_dir.iterdir())
        # A recovered instance can be destroyed by the new runtime.
        rt4 = GVisorRuntime(settings)
        await rt4.start(set())
        inst = await rt4.create(spec([rootfs], "rc-again"))
        await wait_http(inst)
        crash(rt4)
        rt5 = GVisorRuntime(settings)
        rec5 = await rt5.start({inst.id})
        await rt5.destroy(rec5[inst.id])
        await rt5.close()
        assert slot_traces(settings, rec(inst).slot) == []
        assert host_traces(settings)["containers"] == []
    finally:
        await GVisorRuntime(settings).purge()
        assert_no_traces(settings)


async def test_reconcile_with_overlays(
    rootfs: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """After a crash: a kept running sandbox keeps its overlay mount (re-adopted), a kept
    stopped one keeps its slot and can be restored into it, the rest is cleaned up; no
    upper dir is ever deleted."""
    settings = make_settings(
        tmp_path_factory.mktemp("aenv-home-rco"), RECONCILE_PREFIX, RECONCILE_CIDR, pool=1
    )
    try:
        rt1 = GVisorRuntime(settings)
        await rt1.start(set())
        ua, ub, uc = (new_upper(tmp_path, n) for n in ("a", "b", "c"))
        a, b, c = await asyncio.gather(
            rt1.create(rw_spec([rootfs], "rco-a", ua)),
            rt1.create(rw_spec([rootfs], "rco-b", ub)),
            rt1.create(rw_spec([rootfs], "rco-c", uc)),
        )
        await asyncio.gather(wait_http(a), wait_http(b), wait_http(c))
        for x in (a, b, c):
            await sh(x, f"echo {x.sandbox_id} > /root/mine")
        await rt1.checkpoint(c, tmp_path / "img-c", leave_running=False)
        await rt1.stop(c)
        crash(rt1)
        del rt1

        rt2 = GVisorRuntime(settings)
        recovered = await rt2.start({a.id, c.id})
        assert set(recovered) == {a.id, c.id}
        ra, rc = recovered[a.id], recovered[c.id]
        assert not rt2.is_stopped(ra) and rt2.is_stopped(rc)
        assert await rt2.alive(ra) and not await rt2.alive(rc)
        # a: still on its mounted overlay, writing to its upper.
        assert rec(ra).bundle_dir / "rootfs" in mount_points(settings.home)
        await sh(ra, "echo after > /root/after")
        assert (ua / "root" / "after").read_text() == "after\n"
        # b: container, mount and work dir gone; its upper stays.
        assert b.id not in host_traces(settings)["containers"]
        assert rec(b).bundle_dir / "rootfs" not in mount_points(settings.home)
        assert not (tmp_path / "uppers" / f"work-{b.id}").exists()
        assert (ub / "root" / "mine").read_text() == "rco-b\n"
        assert slot_traces(settings, rec(b).slot) == [] or rec(b).slot in _pool_slots(rt2)
        # c: restored into its kept slot on a sealed stack.
        assert slot_traces(settings, rec(c).slot) != []
        sealed = tmp_path / "sealed-c"
        os.rename(uc, sealed)
        rc2 = await rt2.restore(
            rw_spec([sealed, rootfs], "rco-c", new_upper(tmp_path, "c1")),
            tmp_path / "img-c",
            reuse=rc,
        )
        await wait_http(rc2)
        assert (rc2.address, rc2.id) == (c.address, c.id)
        assert "rco-c" in await sh(rc2, "cat /root/mine")
        await asyncio.gather(rt2.destroy(ra), rt2.destroy(rc2))
        await rt2.close()
        traces = host_traces(settings)
        for k in ("containers", "netns", "links", "mounts", "cgroups"):
            assert traces[k] == [], (k, traces)
        assert work_dirs(tmp_path) == []
    finally:
        await GVisorRuntime(settings).purge()
        assert_no_traces(settings)
    assert all(u.is_dir() for u in (ua, ub))
