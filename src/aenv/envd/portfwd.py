"""Ports that a process in the sandbox binds to loopback only, made reachable from outside.

Dev servers bind 127.0.0.1 by default; the node's proxy reaches the sandbox on its external
address, so such a port would be unreachable. As on E2B (whose envd runs a forwarder for
the same reason), envd reads ``/proc/net/tcp`` and ``/proc/net/tcp6`` for LISTEN sockets,
and for each port listened on only on loopback (127.0.0.0/8, ``::1``, their IPv4-mapped
forms) opens a listener on the sandbox's external address that pipes every connection to
the loopback one. It is closed when the loopback listener goes away. A port with any other
listener (``0.0.0.0``, ``::``, the external address) is left alone, and so is envd's own.

On demand, not on a timer: Linux has no notification for a new listening socket, and a
poll every second in every idle sandbox is what an idle node cannot afford. So the node
asks (``POST /forward?port=N``, `forward`) when its proxy found port N refused: one read
of the kept-open tables (two preads, ≈ 13 µs each in gVisor/systrap), the forward opened if
the port is listened on loopback, and the answer says whether the node should try again.
While any forward is open, the tables are read every `interval` to close the forwards whose
listener went away; with none open, nothing runs. The state is plain asyncio servers, two
open files and one task, so a checkpoint, restore or fork keeps forwarding as before.

A program that replaces its loopback listener by one on all addresses within a sweep
interval may find the port still held by the forwarder (``EADDRINUSE``), as on E2B.

On with ``AENV_ENVD_PORT_FORWARD=1`` (the default in a sandbox); ``AENV_ENVD_FORWARD_HOST``
names the address to listen on (default: the source address of the default route).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import sys
from collections.abc import Iterable

from .httpserver import log

POLL_SECONDS = 1.0
_LISTEN = "0A"
_CHUNK = 64 * 1024
# Any address outside the sandbox: a UDP connect() to it only picks a route (no packet is
# sent), whose source is the sandbox's external address. A documentation address (TEST-NET-1).
_ROUTE_PROBE = ("192.0.2.1", 9)

Listener = tuple[str, int]  # (address as text, port)


def _address(hex_text: str) -> str:
    """An address of /proc/net/tcp{,6}: 32-bit words in host byte order, printed in hex.
    An IPv4-mapped one is given as the IPv4 address it accepts connections on."""
    raw = bytes.fromhex(hex_text)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def parse_listeners(text: str) -> list[Listener]:
    """The LISTEN sockets of one /proc/net/tcp or /proc/net/tcp6 text."""
    out: list[Listener] = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4 or fields[3] != _LISTEN:
            continue
        addr, _, port = fields[1].partition(":")
        with contextlib.suppress(ValueError):
            out.append((_address(addr), int(port, 16)))
    return out


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def plan(
    listeners: Iterable[Listener], own: dict[int, str], host: str, skip: Iterable[int] = ()
) -> dict[int, str]:
    """{port: loopback address to forward to} for the ports listened on only on loopback.

    `own`: the ports this forwarder listens on at `host` (its own sockets are in the table
    too and do not count as another listener); `skip`: ports never forwarded."""
    by_port: dict[int, list[str]] = {}
    for address, port in listeners:
        if own.get(port) is not None and address == host:
            continue
        by_port.setdefault(port, []).append(address)
    skipped = set(skip)
    wanted: dict[int, str] = {}
    for port, addresses in by_port.items():
        if port in skipped or not all(_is_loopback(a) for a in addresses):
            continue
        # IPv4 first: what a client of `localhost` tries first, too.
        wanted[port] = sorted(addresses, key=lambda a: ":" in a)[0]
    return wanted


def external_address() -> str | None:
    """The sandbox's own address on its default route; None without one."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(_ROUTE_PROBE)
        return str(s.getsockname()[0])
    except OSError:
        return None
    finally:
        s.close()


class _Table:
    """One /proc/net table, kept open: a pread at offset 0 regenerates it, at a tenth of the
    cost of open+read+close in gVisor. Reopened after an error; empty when it cannot be."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None

    def read(self) -> str:
        for _ in range(2):
            try:
                if self.fd is None:
                    self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                data = b""
                while chunk := os.pread(self.fd, 1 << 16, len(data)):
                    data += chunk
                return data.decode("ascii", "replace")
            except OSError:
                self.close()
        return ""  # no IPv6 in the sandbox, or /proc not mounted

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # half-close: the other side may still answer
    except (ConnectionError, OSError):
        writer.transport.abort()


class PortForwarder:
    """`await PortForwarder(skip={envd_port}).run()` until cancelled; `forward(port)` when
    the node asks."""

    def __init__(
        self, skip: Iterable[int] = (), host: str | None = None, interval: float = POLL_SECONDS
    ) -> None:
        self.skip = set(skip)
        self.host = host
        self.interval = interval
        self.servers: dict[int, tuple[str, asyncio.Server]] = {}
        self._refused: set[tuple[int, str]] = set()  # logged once each
        self.tables = [_Table("/proc/net/tcp"), _Table("/proc/net/tcp6")]
        self._open_any = asyncio.Event()  # set while any forward is open

    async def run(self) -> None:
        """Sweeps every `interval` while forwards are open; sleeps on an event otherwise."""
        try:
            while True:
                await self._open_any.wait()
                await asyncio.sleep(self.interval)
                await self.poll()
        finally:
            for _, server in self.servers.values():
                server.close()
            for table in self.tables:
                table.close()

    async def forward(self, port: int) -> bool:
        """Whether `port` is forwarded now (the node's proxy found it refused): the tables
        are read once and the forwards follow them."""
        await self.poll()
        return port in self.servers

    async def poll(self) -> None:
        listeners = [x for table in self.tables for x in parse_listeners(table.read())]
        own = {port: target for port, (target, _) in self.servers.items()}
        host = self.host or ""
        wanted = plan(listeners, own, host, self.skip)
        for port, (target, server) in list(self.servers.items()):
            if wanted.get(port) != target:
                server.close()  # open connections go on until either side ends them
                del self.servers[port]
        if not wanted.keys() - self.servers.keys():
            self._follow()
            return
        if self.host is None:
            self.host = external_address()
            if self.host is None:
                self._follow()
                return
        for port, target in wanted.items():
            if port not in self.servers:
                await self._open(port, target)
        self._follow()

    def _follow(self) -> None:
        if self.servers:
            self._open_any.set()
        else:
            self._open_any.clear()

    async def _open(self, port: int, target: str) -> None:
        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._connect(target, port, reader, writer)

        assert self.host is not None
        try:
            server = await asyncio.start_server(on_conn, self.host, port, reuse_address=True)
        except OSError as e:
            if (port, target) not in self._refused:
                self._refused.add((port, target))
                log(f"port forward {self.host}:{port} -> {target}:{port}: {e}")
            return
        self.servers[port] = (target, server)
        log(f"port forward {self.host}:{port} -> {target}:{port}")

    @staticmethod
    async def _connect(
        target: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(target, port)
        except OSError:
            writer.transport.abort()  # a reset, as the closed port itself would answer
            return
        try:
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
