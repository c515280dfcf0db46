"""Talking to the gVisor tests' busybox sandboxes over their network (pages, the CGI shell,
counters, probes from inside) and the host-side servers for the isolation tests (on the host's
addresses, and an "internet" host in a netns of its own). `host_servers` and `ext_server` are
fixtures, imported by the test modules for pytest to find.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from aenv.runtime.base import Instance
from aenv.runtime.gvisor import GVisorRuntime
from tests.helpers import async_wait_until
from tests.integration.gvisor_env import EXT_HOST, EXT_IF, EXT_NS, EXT_PEER, PORT, PREFIX

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
