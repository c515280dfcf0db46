"""Tasks a component starts to run on their own (the rest of a destroy, a publish), kept so
that none is garbage-collected mid-flight and all can be awaited together at shutdown; and
the periodic rounds of housekeeping (timers, the sampler, the reaper)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any


class Background:
    def __init__(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        # Told of a task's exception when nobody awaits it (None: whoever joins sees nothing).
        self._on_failure = on_failure
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(
        self,
        coro: Coroutine[Any, Any, Any],
        *,
        name: str | None = None,
        context: contextvars.Context | None = None,
    ) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name, context=context)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if self._on_failure is not None and not task.cancelled():
            exc = task.exception()
            if exc is not None:
                self._on_failure(exc)

    async def join(self) -> None:
        """Waits for every task, those started meanwhile included."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


class Periodic:
    """`work()` every `interval` seconds on a task of its own, from `start` until `stop`. A
    round that fails is logged and the next one runs: housekeeping must never die."""

    def __init__(
        self, name: str, interval: float, work: Callable[[], Awaitable[Any]], log: logging.Logger
    ) -> None:
        self.name, self.interval, self.work, self.log = name, interval, work, log
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"aenv-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.work()
            except Exception:
                self.log.exception("%s", self.name)
