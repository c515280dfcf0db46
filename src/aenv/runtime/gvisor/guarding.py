"""The memory guard of the runtime's running containers: armed for each once someone listens
for memory pressure (`Runtime.on_memory_pressure`), disarmed when it stops or is
checkpointed. `runtime/memguard.py` does the cgroup work; this keeps who listens and which
container a signal is about."""

from __future__ import annotations

from collections.abc import Callable

from aenv.runtime.base import Instance
from aenv.runtime.gvisor.container import Container
from aenv.runtime.memguard import MemoryGuard


class ContainerGuards:
    def __init__(self, find: Callable[[str], Container | None]) -> None:
        # The running container of an id, if this runtime holds it.
        self._find = find
        self._guard: MemoryGuard | None = None
        self._listener: Callable[[Instance], None] | None = None

    def listen(self, listener: Callable[[Instance], None]) -> None:
        """From now on containers are guarded and `listener` hears of their pressure."""
        self._listener = listener
        if self._guard is None:
            self._guard = MemoryGuard(self._pressed)

    async def arm(self, c: Container) -> None:
        if self._guard is not None and c.cgroup:
            await self._guard.arm(c.id, c.cgroup, c.memory_mb * 1024 * 1024)

    def disarm(self, cid: str) -> None:
        if self._guard is not None:
            self._guard.disarm(cid)

    def close(self) -> None:
        if self._guard is not None:
            self._guard.close()

    def _pressed(self, cid: str) -> None:
        c = self._find(cid)
        if c is not None and self._listener is not None and not c.stopped:
            self._listener(c.handle())
