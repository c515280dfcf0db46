"""What a blocking writer (tarfile, zip, a copy loop) writes, as an async stream of chunks: the
writer runs in a thread while the event loop sends what it has written so far, so a request
body is neither built whole first (a temporary file: written, then read again) nor held in
memory."""

from __future__ import annotations

import asyncio
import contextlib
import io
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, BinaryIO

CHUNK = 1 << 20
# Chunks written ahead of the reader (memory: at most this many × CHUNK).
AHEAD = 4


class _Abandoned(Exception):
    """The reader went away: the writer stops."""


class _ChunkWriter(io.RawIOBase):
    def __init__(self, q: queue.Queue[bytes | None], gone: threading.Event) -> None:
        self.q, self.gone = q, gone
        self.buf = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.buf += b
        if len(self.buf) >= CHUNK:
            self._put(bytes(self.buf))
            self.buf.clear()
        return len(b)

    def _put(self, item: bytes | None) -> None:
        while True:
            if self.gone.is_set():
                raise _Abandoned
            try:
                self.q.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def finish(self) -> None:
        if self.buf:
            self._put(bytes(self.buf))
            self.buf.clear()
        self._put(None)


def _run(write: Callable[[BinaryIO], object], out: _ChunkWriter) -> None:
    try:
        try:
            write(out)  # type: ignore[arg-type]  # a RawIOBase is a binary file
        finally:
            out.finish()  # the end is queued even after a failure: the reader never waits on
    except _Abandoned:
        pass


async def produced(write: Callable[[BinaryIO], object]) -> AsyncIterator[bytes]:
    """The bytes `write(f)` writes into `f` (in a thread), chunk by chunk as they come; the
    writer's exception is raised here after what it wrote before it."""
    q: queue.Queue[bytes | None] = queue.Queue(AHEAD)
    gone = threading.Event()
    job = asyncio.ensure_future(asyncio.to_thread(_run, write, _ChunkWriter(q, gone)))
    try:
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                item = await asyncio.to_thread(q.get)
            if item is None:
                break
            yield item
    finally:
        gone.set()
        with contextlib.suppress(queue.Full):  # frees a `get` left waiting by a cancel
            q.put_nowait(None)
        await job  # the writer's exception, if any; an abandoned one ends quietly
