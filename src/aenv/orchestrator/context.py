"""What every part of the orchestrator shares: the settings, the clock, background tasks."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import secrets
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from ..background import Background
from ..config import Settings
from ..domain import utcnow
from ..errors import BadRequest, Unavailable

log = logging.getLogger("aenv.orchestrator")

Clock = Callable[[], datetime]


class Waking(Protocol):
    """What a request does to an idle sandbox (`IdleTracker`): the parts that serve requests
    are made before the tracker (it needs the Pauser), so they reach it through the context."""

    def touch(self, sandbox_id: str) -> None: ...

    async def wake(self, sandbox_id: str, *, restore: bool = True) -> None: ...


class _NeverIdle:
    """Until an idle tracker is made nothing naps: there is nothing to end."""

    def touch(self, sandbox_id: str) -> None:
        pass

    async def wake(self, sandbox_id: str, *, restore: bool = True) -> None:
        pass


@dataclass
class NodeContext:
    settings: Settings
    # Injectable so the state machine's unit tests can move time on.
    clock: Clock = utcnow
    # Set once the node shuts down: nothing speculative starts any more.
    closing: bool = False
    # Set by a drain (cluster): no new sandboxes; the node reports `draining`.
    draining: bool = False
    # Tells this run of the node from earlier ones (boot snapshots are made anew each run).
    run_id: str = field(default_factory=lambda: secrets.token_hex(8))
    _tasks: Background = field(default_factory=Background)
    _stop_listeners: list[Callable[[str], None]] = field(default_factory=list)
    _idle: Waking = field(default_factory=_NeverIdle)

    def now(self) -> datetime:
        return self.clock()

    def check_taking(self) -> None:
        """Refuses (503) a new sandbox — a create's or a fork child's — on a draining node."""
        if self.draining:
            raise Unavailable("this node is draining: it takes no new sandboxes")

    def track_idle(self, tracker: Waking) -> None:
        """The idle tracker, which `touch` and `wake` reach from now on (it calls this)."""
        self._idle = tracker

    def touch(self, sandbox_id: str) -> None:
        """A request for the sandbox that does not reach it: its idle time starts again."""
        self._idle.touch(sandbox_id)

    async def wake(self, sandbox_id: str, *, restore: bool = True) -> None:
        """A request is about to reach the sandbox: its nap or standby ends first
        (`restore=False`: one in standby on disk is left there, for a kill or pause)."""
        await self._idle.wake(sandbox_id, restore=restore)

    def on_stopped(self, listener: Callable[[str], None]) -> None:
        """`listener(sandbox_id)` runs whenever a sandbox's processes end (kill, loss, a
        pause that stops them): the data plane breaks off what it has in flight to it."""
        self._stop_listeners.append(listener)

    def stopped(self, sandbox_id: str) -> None:
        for listener in self._stop_listeners:
            try:
                listener(sandbox_id)
            except Exception:
                log.exception("a stop listener failed for sandbox %s", sandbox_id)

    def spawn(
        self, coro: Coroutine[Any, Any, Any], name: str | None = None, *, detached: bool = False
    ) -> asyncio.Task[Any]:
        """Runs `coro` in the background; the node waits for it at shutdown. `detached`:
        work for no sandbox in particular (its log lines do not carry the caller's)."""
        return self._tasks.spawn(
            coro, name=name, context=contextvars.Context() if detached else None
        )

    async def join(self) -> None:
        """Waits for every background task (at shutdown, and in tests)."""
        await self._tasks.join()


def check_timeout(timeout: int | None, settings: Settings) -> None:
    """The range check of a sandbox timeout in seconds (None: the default applies). Its upper
    bound is a setting, so the API's pydantic models cannot hold it: the API calls this before
    doing any work, the orchestrator again for its other callers."""
    if timeout is not None and not 0 <= timeout <= settings.max_timeout:
        raise BadRequest(f"timeout must be between 0 and {settings.max_timeout} seconds")
