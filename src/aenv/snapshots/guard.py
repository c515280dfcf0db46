"""Publishes and sweeps of one process kept apart (see `sweeping.py`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class SweepGuard:
    """Many publishes at once, or one sweep alone (in this process): a sweep must not delete
    an object a concurrent publish just decided to reuse."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._publishing = 0
        self._sweeping = False

    @contextlib.asynccontextmanager
    async def publishing(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._sweeping)
            self._publishing += 1
        try:
            yield
        finally:
            async with self._cond:
                self._publishing -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def sweeping(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._sweeping and self._publishing == 0)
            self._sweeping = True
        try:
            yield
        finally:
            async with self._cond:
                self._sweeping = False
                self._cond.notify_all()
