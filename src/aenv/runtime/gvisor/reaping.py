"""The runtime's hold on the runsc processes `runsc run --detach` orphans: while a runtime
is started its process is their child subreaper and reaps them (see `_proc`); once it
closes it no longer is."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aenv.runtime import _proc

log = logging.getLogger("aenv.runtime")


class Reaper:
    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self.active = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Becomes the subreaper and starts the sweep; without the kernel's support a
        stopped container's delete waits for the host's init to reap it."""
        if not self.active:
            self.active = _proc.become_subreaper()
            if not self.active:
                log.warning("cannot become a child subreaper: deleting containers is slower")
        if self.active and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="aenv-reaper")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.active:
            # A process that outlives its runtime (a test session that ran one in-process)
            # would go on adopting orphans that nothing reaps any more: the zombie runsc
            # processes of other nodes it started then make their `runsc delete` wait.
            self.active = not _proc.become_subreaper(False)
            await asyncio.to_thread(_proc.reap_adopted)

    async def _loop(self) -> None:
        """Reaps runsc processes that exited on their own (a sandbox's systrap stubs, a
        sandbox that died): stop/destroy reap what they end, this catches the rest."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await asyncio.to_thread(_proc.reap_adopted)
            except Exception as e:  # never let housekeeping die
                log.warning("reaping runsc processes: %s", e)
