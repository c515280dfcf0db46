"""The runtime's hold on the runsc processes `runsc run --detach` orphans: while a runtime
is started its process is their child subreaper and reaps them (see `_proc`); once it
closes it no longer is."""

from __future__ import annotations

import asyncio
import logging

from aenv.background import Periodic
from aenv.runtime import _proc

log = logging.getLogger("aenv.runtime")


class Reaper:
    def __init__(self, interval: float = 10.0) -> None:
        self.active = False
        # Runsc processes that exited on their own (a sandbox's systrap stubs, a sandbox
        # that died): stop/destroy reap what they end, this catches the rest.
        self.sweep = Periodic("runsc reaper", interval, self._reap, log)

    def start(self) -> None:
        """Becomes the subreaper and starts the sweep; without the kernel's support a
        stopped container's delete waits for the host's init to reap it."""
        if not self.active:
            self.active = _proc.become_subreaper()
            if not self.active:
                log.warning("cannot become a child subreaper: deleting containers is slower")
        if self.active:
            self.sweep.start()

    async def close(self) -> None:
        await self.sweep.stop()
        if self.active:
            # A process that outlives its runtime (a test session that ran one in-process)
            # would go on adopting orphans that nothing reaps any more: the zombie runsc
            # processes of other nodes it started then make their `runsc delete` wait.
            self.active = not _proc.become_subreaper(False)
            await asyncio.to_thread(_proc.reap_adopted)

    async def _reap(self) -> None:
        await asyncio.to_thread(_proc.reap_adopted)
