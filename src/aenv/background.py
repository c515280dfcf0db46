"""Tasks a component starts to run on their own (the rest of a destroy, a publish), kept so
that none is garbage-collected mid-flight and all can be awaited together at shutdown."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine
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
