"""envd's forwarding of loopback-only ports: which listeners it forwards, and the pipe."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from pathlib import Path

import pytest

from aenv.envd.portfwd import PortForwarder, _Table, parse_listeners, plan
from tests.helpers import async_wait_until

# Captured from gVisor (runsc do): 127.0.0.1:8123, 0.0.0.0:8125, an established socket.
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1FBB 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   1: 0100007F:1FBB 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 4 1
   2: 00000000:1FBD 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3 1
   3: 1500FEA9:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5 1
"""
# ::1:8124, :::8126, ::ffff:127.0.0.1:8127 (IPv4-mapped: given as 127.0.0.1).
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue
   1: 00000000000000000000000001000000:1FBC 00000000000000000000000000000000:0000 0A 00000000
   2: 00000000000000000000000000000000:1FBE 00000000000000000000000000000000:0000 0A 00000000
   3: 0000000000000000FFFF00000100007F:1FBF 00000000000000000000000000000000:0000 0A 00000000
"""


@pytest.mark.skipif(sys.byteorder != "little", reason="the captured tables are little-endian")
def test_parse_listeners() -> None:
    assert parse_listeners(TCP) == [
        ("127.0.0.1", 8123),
        ("0.0.0.0", 8125),
        ("169.254.0.21", 80),
    ]
    assert parse_listeners(TCP6) == [("::1", 8124), ("::", 8126), ("127.0.0.1", 8127)]
    assert parse_listeners("") == [] and parse_listeners("header\ngarbage line\n") == []


def test_plan_forwards_loopback_only_ports() -> None:
    host = "169.254.0.21"
    listeners = [
        ("127.0.0.1", 3000),  # forwarded
        ("::1", 3000),
        ("::1", 3001),  # forwarded, to ::1
        ("127.0.0.2", 3002),  # all of 127/8
        ("127.0.0.3", 3003),
        ("127.0.0.1", 8080),  # also on all addresses: reachable already
        ("0.0.0.0", 8080),
        ("127.0.0.1", 8081),
        ("::", 8081),
        ("127.0.0.1", 8082),  # also on the external address by someone else
        (host, 8082),
        ("0.0.0.0", 49983),
        ("127.0.0.1", 49984),  # skipped by number
    ]
    assert plan(listeners, {}, host, skip={49984}) == {
        3000: "127.0.0.1",
        3001: "::1",
        3002: "127.0.0.2",
        3003: "127.0.0.3",
    }
    # The forwarder's own listener does not hide the port; once the loopback one is gone,
    # the port leaves the plan (and its forwarder is closed).
    assert plan([("127.0.0.1", 3000), (host, 3000)], {3000: "127.0.0.1"}, host) == {
        3000: "127.0.0.1"
    }
    assert plan([(host, 3000)], {3000: "127.0.0.1"}, host) == {}


async def test_forwarder_pipes_and_follows_the_listener(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loopback server on 127.0.0.1 reached through the forwarder's listener on another
    loopback address (127.0.0.9 stands for the sandbox's external one), closed when the
    server goes."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read()  # until the client's half-close
        writer.write(b"echo:" + data)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    table = {"listeners": [("127.0.0.1", port)]}
    monkeypatch.setattr("aenv.envd.portfwd._Table.read", lambda self: self.path)
    monkeypatch.setattr(
        "aenv.envd.portfwd.parse_listeners",
        lambda path: [] if path.endswith("6") else table["listeners"],
    )
    fwd = PortForwarder(host="127.0.0.9")
    try:
        await fwd.poll()
        assert list(fwd.servers) == [port]
        reader, writer = await asyncio.open_connection("127.0.0.9", port)
        writer.write(b"hello")
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 10) == b"echo:hello"
        writer.close()

        server.close()
        await server.wait_closed()
        table["listeners"] = [("127.0.0.9", port)]  # only the forwarder's own socket left
        await fwd.poll()
        assert fwd.servers == {}
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.9", port), timeout=5).close()
    finally:
        for _, s in fwd.servers.values():
            s.close()


def test_table_reads_fresh_contents_each_time(tmp_path: Path) -> None:
    path = tmp_path / "tcp"
    path.write_text("header\n")
    table = _Table(str(path))
    assert table.read() == "header\n"
    path.write_text("header\n" + "x" * 100_000)  # longer than one pread
    assert table.read() == "header\n" + "x" * 100_000
    table.close()
    path.unlink()
    assert table.read() == ""  # gone, and cannot be reopened


async def test_forwarder_reads_the_tables_only_when_asked_or_while_forwarding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Idle, the forwarder does nothing; `forward(port)` reads the tables once and opens the
    forward; it then sweeps until the listener is gone, and stops sweeping."""

    async def nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(nothing, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    table = {"listeners": [("127.0.0.1", port)]}
    reads: list[str] = []

    def read(self: _Table) -> str:
        reads.append(self.path)
        return self.path

    monkeypatch.setattr("aenv.envd.portfwd._Table.read", read)
    monkeypatch.setattr(
        "aenv.envd.portfwd.parse_listeners",
        lambda path: [] if path.endswith("6") else table["listeners"],
    )
    fwd = PortForwarder(host="127.0.0.9", interval=0.05)
    task = asyncio.create_task(fwd.run())
    try:
        # Nothing happening is the case here: six sweep intervals, in which an idle
        # forwarder that polled anyway would have read the tables (no event to wait for).
        await asyncio.sleep(6 * fwd.interval)
        assert reads == []  # nothing asked, nothing open: no reads at all
        assert await fwd.forward(port + 1 if port < 65535 else port - 1) is False
        assert await fwd.forward(port) is True
        asked = len(reads)
        # Sweeping while the forward is open: three sweeps (two tables each) of its own.
        await async_wait_until(lambda: len(reads) >= asked + 6, 10, 0.01, "three sweeps")
        table["listeners"] = [("127.0.0.9", port)]
        await async_wait_until(lambda: fwd.servers == {}, 10, 0.01, "the forward to close")
        settled = len(reads)
        await asyncio.sleep(6 * fwd.interval)  # as above: six intervals without a sweep
        assert len(reads) == settled  # none open: the sweeping stopped
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        server.close()
