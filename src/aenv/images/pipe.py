"""Handing a layer's bytes from the event loop to the thread that unpacks them."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from .streams import CHUNK

T = TypeVar("T")


class BlobPipe:
    """Chunks handed from an event loop (producer) to a worker thread (consumer).

    The producer awaits `put` for each chunk and calls `close(error)` exactly once at the
    end; the consumer `read`s like a file. If the consumer gives up (`abort`), `put` returns
    False so the producer can stop. A full pipe suspends the producer on an asyncio event
    (no thread is parked for it), so any number of pipes can be active at once."""

    def __init__(self, max_chunks: int = 16) -> None:
        self._cv = threading.Condition()
        self._chunks: deque[bytes] = deque()
        self._max = max_chunks
        self._buf = b""
        self._closed = False
        self._aborted = False
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._space: asyncio.Event | None = None

    # producer side (event loop)
    async def put(self, chunk: bytes) -> bool:
        if self._space is None:
            self._loop = asyncio.get_running_loop()
            self._space = asyncio.Event()
        while True:
            with self._cv:
                if self._aborted:
                    return False
                if len(self._chunks) < self._max:
                    self._chunks.append(chunk)
                    self._cv.notify()
                    return True
                self._space.clear()
            await self._space.wait()

    def close(self, error: BaseException | None = None) -> None:
        with self._cv:
            self._error = error
            self._closed = True
            self._cv.notify_all()

    # consumer side (thread)
    def _wake_producer(self) -> None:
        loop, space = self._loop, self._space
        if loop is not None and space is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone
                loop.call_soon_threadsafe(space.set)

    def abort(self) -> None:
        with self._cv:
            self._aborted = True
        self._wake_producer()

    def read(self, n: int = -1, /) -> bytes:
        if n is None or n < 0:
            n = CHUNK
        if not self._buf:
            with self._cv:
                while not self._chunks and not self._closed:
                    self._cv.wait()
                if self._chunks:
                    self._buf = self._chunks.popleft()
                elif self._error is not None:
                    raise self._error
                else:
                    return b""
            self._wake_producer()
        data, self._buf = self._buf[:n], self._buf[n:]
        return data


def run_in_thread(fn: Callable[[], T], name: str = "aenv-unpack") -> asyncio.Future[T]:
    """Runs `fn` in a new thread of its own (not the shared default executor, whose few
    workers a burst of concurrent layer unpacks would exhaust); returns a future for it."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def target() -> None:
        try:
            result = fn()
        except BaseException as e:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, None, e)
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=target, name=name, daemon=True).start()
    return fut
