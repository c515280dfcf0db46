"""The `thousand` scenario (issue 21): 1,000 sandboxes on one node, as an RL run keeps them —
a few working, the idle majority in standby — created, listed, reached with a command each
and killed, on a server of its own whose sandboxes opt into standby at once
(`AENV_NAP_AFTER`, `AENV_STANDBY_AFTER`) and whose memory budget overcommits
(`AENV_MEMORY_OVERCOMMIT`): a create the budget cannot hold sends the sandboxes idle
longest to disk (standby on disk), and a command to one on disk restores it.

Rows: time per create past the first 100 (the node full of sandboxes), a whole listing with
all present, a command each (most restored from disk first), a kill each, the server's RSS
with all present and the machine's memory per sandbox."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from .client import Api, BenchError, Sbx
from .hostproc import rss_mib
from .plan import Plan, Progress
from .stats import Results

ROWS = [
    "thousand_create",
    "thousand_list",
    "thousand_exec",
    "thousand_kill",
    "thousand_node_rss_mib",
    "thousand_mem_per_sandbox_mib",
]
# The budget (90% of RAM) times 2: ~170 sandboxes of MEMORY_MB hold memory at once here.
ENV = {
    "AENV_NAP_AFTER": "2",
    "AENV_STANDBY_AFTER": "3",
    "AENV_STANDBY_DISK_AFTER": "0",
    "AENV_MEMORY_OVERCOMMIT": "2",
    "AENV_SANDBOX_POOL_SIZE": "0",
}
MEMORY_MB = 256
AT_ONCE = 4
# Creates before the node is "full" (their times are not rows).
WARM = 100
LISTS = 10
FREEZER = Path("/sys/fs/cgroup/freezer")


def count(plan: Plan) -> int:
    return 150 if plan.mode == "quick" else 1000


def used_memory_mib() -> float:
    """The machine's memory in use (total - available), MiB."""
    info: dict[str, int] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        info[name] = int(rest.split()[0])
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


def in_memory(ids: set[str]) -> int:
    """How many of the sandboxes `ids` have a container (running or frozen): the rest are on
    disk. Their freezer cgroups are named `<sandbox id>-<suffix>` under the node's prefix."""
    found = set()
    for d in FREEZER.glob("*/*"):
        sid = d.name.rsplit("-", 1)[0]
        if sid in ids:
            found.add(sid)
    return len(found)


class Thousand:
    def __init__(
        self,
        api: Api,
        server_pid: int | None,
        results: Results,
        plan: Plan,
        progress: Progress,
    ) -> None:
        self.api = api
        self.server_pid = server_pid
        self.results = results
        self.plan = plan
        self.progress = progress
        self.n = count(plan)
        self.made: list[Sbx] = []

    async def run(self) -> None:
        before = used_memory_mib()
        try:
            await self._creates()
            ids = {s.sandbox_id for s in self.made}
            self._footprint(before, ids)
            await self._lists()
            await self._execs(ids)
        finally:
            await self._kills()

    async def _each(
        self, what: str, items: list[int], one: Callable[[int], Awaitable[None]]
    ) -> None:
        """`one(i)` for each item, AT_ONCE at a time, with progress; the first error ends it."""
        sem = asyncio.Semaphore(AT_ONCE)
        self.progress.step(what, len(items))

        async def guarded(i: int) -> None:
            async with sem:
                await one(i)
                self.progress.advance()

        tasks = [asyncio.ensure_future(guarded(i)) for i in items]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def _creates(self) -> None:
        async def one(i: int) -> None:
            sbx, t = await self.api.create(memory_mb=MEMORY_MB, timeout_s=3600)
            self.made.append(sbx)
            if i >= WARM:
                self.results.add("thousand_create", t.ms, t.stages)

        await self._each(f"thousand: create {self.n}", list(range(self.n)), one)

    def _footprint(self, before: float, ids: set[str]) -> None:
        resident = in_memory(ids)
        after = used_memory_mib()
        self.results.add("thousand_mem_per_sandbox_mib", (after - before) / len(ids))
        if self.server_pid is not None:
            self.results.add("thousand_node_rss_mib", rss_mib([self.server_pid]))
        self.results.note(
            "thousand_mem_per_sandbox_mib",
            f"{len(ids)} sandboxes of {MEMORY_MB} MiB: {resident} in memory (running or frozen), "
            f"{len(ids) - resident} in standby on disk; machine memory in use "
            f"{before:.0f} -> {after:.0f} MiB",
        )

    async def _lists(self) -> None:
        for _ in range(LISTS):
            t = await self.api.list_timed(limit=1000)
            if len(t.data) < len(self.made):
                raise BenchError(f"list: {len(t.data)} sandboxes listed of {len(self.made)}")
            self.results.add("thousand_list", t.ms)

    async def _execs(self, ids: set[str]) -> None:
        resident = in_memory(ids)
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            t = await self.api.run(self.made[i], "true")
            self.results.add("thousand_exec", t.ms, t.stages)

        await self._each(f"thousand: a command in each of {self.n}", list(range(self.n)), one)
        self.results.note(
            "thousand_exec",
            f"{self.n - resident} of {self.n} restored from disk by their command; "
            f"{AT_ONCE} at once, {time.perf_counter() - t0:.0f} s in all",
        )

    async def _kills(self) -> None:
        made = list(self.made)

        async def one(i: int) -> None:
            t0 = time.perf_counter()
            await self.api.kill(made[i].sandbox_id)
            self.results.add("thousand_kill", (time.perf_counter() - t0) * 1000)

        await self._each(f"thousand: kill {len(made)}", list(range(len(made))), one)
