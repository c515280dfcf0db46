"""`Idempotency-Key` on create: the same key within the TTL returns the first response.

In memory and per process: the key protects SDK retries of one create call, which arrive at
the same node within seconds. Requests with the same key are serialised, so a retry that
overlaps the first attempt waits for it instead of creating a second sandbox. Failures are not
remembered: a retry after an error tries again.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aenv.errors import BadRequest

T = TypeVar("T")

IDEMPOTENCY_HEADER = "Idempotency-Key"
_KEY_RE = re.compile(r"[a-z0-9-]{1,255}")


def validate_key(key: str | None) -> str | None:
    if key is None:
        return None
    if not _KEY_RE.fullmatch(key):
        raise BadRequest(
            f"invalid {IDEMPOTENCY_HEADER}: use 1-255 characters of lowercase letters, digits and '-'"
        )
    return key


class IdempotencyCache:
    def __init__(self, ttl: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self._clock = clock
        self._entries: dict[str, tuple[float, Any]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _purge(self) -> None:
        now = self._clock()
        for key in [k for k, (expires, _) in self._entries.items() if expires <= now]:
            del self._entries[key]
        for key in [
            k for k, lock in self._locks.items() if k not in self._entries and not lock.locked()
        ]:
            del self._locks[key]

    async def run(self, key: str | None, create: Callable[[], Awaitable[T]]) -> T:
        """`create()`, or the value it returned for `key` within the last `ttl` seconds."""
        if key is None:
            return await create()
        self._purge()
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] > self._clock():
                value: T = entry[1]
                return value
            value = await create()
            self._entries[key] = (self._clock() + self.ttl, value)
            return value
