"""A blocking writer's output as an async stream (`aenv/threadstream.py`): every byte in
order, the writer's error after what it wrote, and a reader that stops early does not leave
the writer (or a thread) waiting."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import BinaryIO

import pytest

from aenv.threadstream import CHUNK, produced


def test_every_byte_arrives_in_order_in_bounded_chunks() -> None:
    data = os.urandom(5 * CHUNK + 123)

    def write(f: BinaryIO) -> None:
        for i in range(0, len(data), 7000):  # small writes, as tarfile's
            f.write(data[i : i + 7000])

    async def main() -> list[bytes]:
        return [c async for c in produced(write)]

    chunks = asyncio.run(main())
    assert b"".join(chunks) == data
    assert all(len(c) <= CHUNK + 7000 for c in chunks) and len(chunks) >= 5


def test_the_writers_error_comes_after_what_it_wrote() -> None:
    def write(f: BinaryIO) -> None:
        f.write(b"x" * 10)
        raise OSError("disk gone")

    seen: list[bytes] = []

    async def collect() -> None:
        async for c in produced(write):
            seen.append(c)

    with pytest.raises(OSError, match="disk gone"):
        asyncio.run(collect())
    assert b"".join(seen) == b"x" * 10


def test_a_reader_that_stops_early_ends_the_writer() -> None:
    ended = threading.Event()

    def write(f: BinaryIO) -> None:
        try:
            while True:  # would never end on its own
                f.write(b"y" * CHUNK)
        finally:
            ended.set()

    async def main() -> None:
        stream = produced(write)
        async for _ in stream:
            break
        await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(asyncio.wait_for(main(), 30))
    assert ended.wait(5)
