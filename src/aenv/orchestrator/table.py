"""The node's sandboxes in memory: records (written to the catalog on every change), one lock
per sandbox so lifecycle operations on one sandbox never interleave, and the memory budget."""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Awaitable, Callable

from ..domain import HOLDS_MEMORY, LIVE_STATES, Quota, SandboxRecord, SandboxState
from ..errors import NotFound, TooManyRequests, Unavailable
from .catalog import Catalog

# Rounds of making room for one admission before it is refused.
ADMIT_TRIES = 8
# Seconds between looks for room while an admission is patient.
ADMIT_WAIT = 0.25
# Seconds a create refused for memory is told to wait (Retry-After).
MEMORY_RETRY_AFTER = 5
# States in which a sandbox id means nothing to its user.
_HIDDEN = frozenset({SandboxState.KILLED, SandboxState.KILLING, SandboxState.CREATING})


async def _no_room(_memory_mb: int) -> int:
    return 0


class SandboxTable:
    def __init__(self, catalog: Catalog, memory_budget_mb: int, max_sandboxes: int = 0) -> None:
        self.catalog = catalog
        self.memory_budget_mb = memory_budget_mb
        self.max_sandboxes = max_sandboxes
        self._records: dict[str, SandboxRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # An API key's quota by its name (the API sets it from its key store); no limits.
        self.quotas: Callable[[str], Quota | None] = lambda _owner: None
        # Frees up to `n` MiB of the budget if it can (the idle tracker sends sandboxes in
        # standby to disk) and says how much it freed; `admit` calls it when the budget is short.
        self.room_maker: Callable[[int], Awaitable[int]] = _no_room

    async def admit(self, memory_mb: int, *, patience: float = 0.0) -> None:
        """`reserve`, after making room for `memory_mb` more if the budget is short. Others
        admitted meanwhile may take the room made: it tries again while room is being made,
        and for `patience` seconds more while none can be (sandboxes end, pause and go to
        standby all the time)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        made = 0
        while True:
            short = self.memory_in_use() + memory_mb - self.memory_budget_mb
            if short <= 0:
                break
            if await self.room_maker(short) > 0:
                made += 1
                if made < ADMIT_TRIES:
                    continue  # made, but maybe taken by another admission: look again
            if loop.time() >= deadline:
                break
            await asyncio.sleep(ADMIT_WAIT)
        self.reserve(memory_mb)

    def add(self, r: SandboxRecord) -> None:
        self._records[r.sandbox_id] = r

    def discard(self, sandbox_id: str) -> None:
        self._records.pop(sandbox_id, None)
        self._locks.pop(sandbox_id, None)

    def find(self, sandbox_id: str) -> SandboxRecord | None:
        """The record whatever its state (internal callers)."""
        return self._records.get(sandbox_id)

    def get(self, sandbox_id: str) -> SandboxRecord:
        """The record as its user may see it; NotFound otherwise."""
        r = self._records.get(sandbox_id)
        if r is None or r.state in _HIDDEN:
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        if r.state is SandboxState.LOST:
            raise NotFound(f"sandbox {sandbox_id!r} was lost: {r.note}")
        return r

    def all(self) -> builtins.list[SandboxRecord]:
        return list(self._records.values())

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        lock = self._locks.get(sandbox_id)
        if lock is None:
            lock = self._locks[sandbox_id] = asyncio.Lock()
        return lock

    async def stored(self) -> builtins.list[SandboxRecord]:
        """What the catalog holds (at start-up, before anything is in memory)."""
        return await asyncio.to_thread(self.catalog.sandboxes)

    async def save(self, r: SandboxRecord) -> None:
        await asyncio.to_thread(self.catalog.put_sandbox, r)

    async def delete(self, r: SandboxRecord) -> None:
        """Forgets the sandbox here and in the catalog."""
        self.discard(r.sandbox_id)
        await asyncio.to_thread(self.catalog.delete_sandbox, r.sandbox_id)

    def list(
        self,
        *,
        metadata: dict[str, str] | None = None,
        states: set[str] | None = None,
        template: str | None = None,
    ) -> builtins.list[SandboxRecord]:
        out = []
        for r in self._records.values():
            if r.state not in LIVE_STATES:
                continue
            api_state = "paused" if r.shown_paused else "running"
            if states and api_state not in states:
                continue
            if template and template not in (r.template_id, r.alias):
                continue
            if metadata and any(r.metadata.get(k) != v for k, v in metadata.items()):
                continue
            out.append(r)
        out.sort(key=lambda r: (r.started_at, r.sandbox_id))
        return out

    def memory_in_use(self) -> int:
        return sum(r.memory_mb for r in self._records.values() if r.state in HOLDS_MEMORY)

    def check_quota(self, owner: str | None, memory_mb: int, count: int = 1) -> None:
        """Refuses (429) `count` more sandboxes of `memory_mb` each for the API key `owner`
        past its quota (`quotas(owner)`: set from the key store by the API)."""
        quota = self.quotas(owner) if owner is not None else None
        if quota is None:
            return
        mine = [r for r in self._records.values() if r.owner == owner and r.state in HOLDS_MEMORY]
        if quota.max_sandboxes is not None and len(mine) + count > quota.max_sandboxes:
            raise TooManyRequests(
                f"API key {owner!r} already runs {len(mine)} of its maximum of "
                f"{quota.max_sandboxes} concurrent sandboxes; kill or pause one and try again"
            )
        used = sum(r.memory_mb for r in mine)
        if quota.max_memory_mb is not None and used + count * memory_mb > quota.max_memory_mb:
            raise TooManyRequests(
                f"API key {owner!r} holds {used} MiB of its maximum of {quota.max_memory_mb} "
                f"MiB of sandbox memory; {count * memory_mb} MiB more do not fit"
            )

    def reserve(self, memory_mb: int) -> None:
        """Admission: refuses a sandbox the memory budget cannot hold. The caller adds its
        record (in a state that holds memory) before it next yields to the loop."""
        if self.max_sandboxes:
            held = sum(1 for r in self._records.values() if r.state in HOLDS_MEMORY)
            if held >= self.max_sandboxes:
                raise TooManyRequests(
                    f"this node already runs its maximum of {self.max_sandboxes} concurrent "
                    "sandboxes; kill or pause one and try again"
                )
        used = self.memory_in_use()
        if used + memory_mb > self.memory_budget_mb:
            # Sandboxes end, pause or go to standby all the time: worth another try soon.
            raise Unavailable(
                f"not enough memory on this node: {used} MiB of {self.memory_budget_mb} MiB "
                f"in use, {memory_mb} MiB requested",
                retry_after=MEMORY_RETRY_AFTER,
            )
