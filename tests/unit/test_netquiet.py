"""The node's connections to a sandbox, aborted before a checkpoint, then a round trip
through the sandbox as a barrier: on loopback addresses of the test's own servers."""

from __future__ import annotations

import asyncio
import os

import pytest

from aenv.runtime.gvisor import netquiet

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="SOCK_DESTROY needs CAP_NET_ADMIN")


async def _server(address: str, *, close_on_eof: bool) -> tuple[asyncio.Server, list[int]]:
    """A listener like envd's (closes a connection at its end of input) or one that never
    closes; the list counts the connections it took."""
    taken: list[int] = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        taken.append(1)
        while await reader.read(4096):
            pass
        if not close_on_eof:
            await asyncio.sleep(3600)
        writer.close()

    return await asyncio.start_server(on_conn, address, 0), taken


def test_aborted_connections_are_followed_by_a_round_trip() -> None:
    async def go() -> None:
        server, taken = await _server("127.77.1.1", close_on_eof=True)
        port = server.sockets[0].getsockname()[1]
        async with server:
            reader, writer = await asyncio.open_connection("127.77.1.1", port)
            await netquiet.drop_connections("127.77.1.1", port)
            with pytest.raises(ConnectionError):
                writer.write(b"x")
                await writer.drain()
                await reader.read(1)
            writer.close()
            assert len(taken) == 2  # ours, then the barrier's

    asyncio.run(go())


def test_no_connection_no_barrier() -> None:
    async def go() -> None:
        server, taken = await _server("127.77.1.2", close_on_eof=True)
        port = server.sockets[0].getsockname()[1]
        async with server:
            await netquiet.drop_connections("127.77.1.2", port)
            # A round trip of our own: the server has taken every connection made before it.
            assert await netquiet.barrier("127.77.1.2", port)
            assert len(taken) == 1  # only ours: nothing to drop, no barrier

    asyncio.run(go())


def test_a_barrier_that_gets_no_answer_gives_up_in_time() -> None:
    async def go() -> None:
        server, _ = await _server("127.77.1.3", close_on_eof=False)
        port = server.sockets[0].getsockname()[1]
        async with server:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            assert not await netquiet.barrier("127.77.1.3", port, timeout=0.3)
            assert loop.time() - t0 < 2
            assert await netquiet.barrier("127.77.1.9", 9, timeout=0.3) is False  # refused

    asyncio.run(go())
