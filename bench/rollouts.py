"""The `rollouts` scenario (issue 21): the episode of an agent-RL rollout, at 1, 8 and 32 at
once (quick: 1 and 8), through the server's API here and with raw runsc in
`rollouts_raw.py`, measured alike: CPU-seconds per episode (the machine's, split into the
server's own process, the sandboxes' cgroups and the rest: runsc commands, kernel, host),
episodes per minute per core, `/health` under the load (a probe process of its own), and
p50/p95/p99 per operation.

One episode: create a sandbox from a task snapshot (made once, before the levels), run 10
commands, fork it into 2 children, run 3 commands in each child, kill all three."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .client import Api, BenchError, Sbx
from .cpu import CpuMeter, CpuSplit
from .plan import Plan, Progress
from .probe import HealthProbe
from .stats import Results

# Small enough that 32 episodes (up to 96 sandboxes) fit this machine's memory budget.
MEMORY_MB = 192
EPISODE_CMDS = 10
CHILD_CMDS = 3
TASK_SETUP = "mkdir -p /home/user/task && cd /home/user/task && seq 1 100 > data.txt"
STEP = "cd /home/user/task && echo step >> log.txt && wc -l < data.txt"


def levels(plan: Plan) -> list[tuple[int, int]]:
    """(episodes at once, episodes) per level."""
    if plan.mode == "quick":
        return [(1, 3), (8, 16)]
    return [(1, 10), (8, 40), (32, 64)]


@dataclass
class Level:
    """What one level measured."""

    at_once: int
    episodes: int = 0
    failed: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    cpu: CpuSplit | None = None
    ops: dict[str, list[float]] = field(default_factory=dict)

    def op(self, name: str, ms: float) -> None:
        self.ops.setdefault(name, []).append(ms)

    def ops_note(self) -> str:
        parts = []
        for name, values in sorted(self.ops.items()):
            if len(values) >= 2:
                q = statistics.quantiles(sorted(values), n=100, method="inclusive")
                parts.append(f"{name} p50/p95/p99 {q[49]:.0f}/{q[94]:.0f}/{q[98]:.0f} ms")
            elif values:
                parts.append(f"{name} {values[0]:.0f} ms")
        return "; ".join(parts)


Episode = Callable[[Level], Awaitable[None]]


async def run_level(
    at_once: int, count: int, episode: Episode, meter: CpuMeter, progress: Progress
) -> Level:
    """`count` episodes, `at_once` of them running at any time."""
    lv = Level(at_once)
    sem = asyncio.Semaphore(at_once)

    async def one() -> None:
        async with sem:
            try:
                await episode(lv)
                lv.episodes += 1
            except BenchError as exc:
                lv.failed.append(str(exc))
            finally:
                progress.advance()

    a = meter.sample()
    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    lv.wall_s = time.perf_counter() - t0
    lv.cpu = CpuMeter.split(a, meter.sample())
    return lv


def record(results: Results, lv: Level, *, baseline: bool, health: HealthProbe | None) -> None:
    n = lv.at_once
    cpu_row, rate_row = f"rollout_cpu_s_{n}", f"rollout_rate_{n}"
    if not lv.episodes or lv.cpu is None:
        results.missing(
            [cpu_row, rate_row], f"no episode finished: {lv.failed[:1]}", baseline=baseline
        )
        return
    per = lv.cpu.per(lv.episodes)
    results.add(cpu_row, per.total_s, baseline=baseline)
    cores = os.cpu_count() or 1
    results.add(rate_row, lv.episodes / (lv.wall_s / 60) / cores, baseline=baseline)
    failed = f", {len(lv.failed)} failed (first: {lv.failed[0]})" if lv.failed else ""
    results.note(
        cpu_row,
        f"{lv.episodes} episodes, {n} at once, in {lv.wall_s:.1f} s{failed}; per episode: "
        f"{per.describe()}; {lv.ops_note()}",
        baseline=baseline,
    )
    if health is not None:
        row = f"rollout_health_p99_{n}"
        p99, p50 = health.quantile(0.99), health.quantile(0.5)
        if p99 is None or p50 is None:
            results.missing([row], "the probe measured nothing")
            return
        results.add(row, p99)
        lost = f", {health.failures} failed" if health.failures else ""
        results.note(
            row,
            f"GET /health every 100 ms from a probe process (nice -10) during the level: "
            f"{len(health.latencies)} probes, p50 {p50:.1f} ms{lost}",
        )


class ServerRollouts:
    """The scenario through the server's API."""

    def __init__(
        self,
        api: Api,
        url: str,
        results: Results,
        plan: Plan,
        progress: Progress,
        meter: CpuMeter,
    ) -> None:
        self.api, self.url, self.results = api, url, results
        self.plan, self.progress, self.meter = plan, progress, meter
        self.task: str | None = None

    async def make_task(self) -> None:
        """The task snapshot every episode starts from: a prepared sandbox's."""
        sbx, _ = await self.api.create(memory_mb=MEMORY_MB)
        try:
            await self.api.run(sbx, TASK_SETUP)
            self.task, _ = await self.api.snapshot(sbx.sandbox_id)
        finally:
            await self.api.kill(sbx.sandbox_id)

    async def drop_task(self) -> None:
        if self.task is not None:
            await self.api.delete_snapshot(self.task)
            self.task = None

    async def run(self) -> None:
        self.progress.step("rollouts: task snapshot", 1)
        try:
            await self.make_task()
        finally:
            self.progress.advance()
        try:
            for at_once, count in levels(self.plan):
                self.progress.step(f"rollouts: {count} episodes, {at_once} at once", count)
                probe = HealthProbe(self.url)
                async with probe.running():
                    lv = await run_level(at_once, count, self.episode, self.meter, self.progress)
                record(self.results, lv, baseline=False, health=probe)
        finally:
            await self.drop_task()

    async def _timed(self, lv: Level, name: str, fn: Callable[[], Awaitable[object]]) -> None:
        t0 = time.perf_counter()
        await fn()
        lv.op(name, (time.perf_counter() - t0) * 1000)

    async def episode(self, lv: Level) -> None:
        assert self.task is not None
        made: list[Sbx] = []
        try:
            t0 = time.perf_counter()
            sbx, _ = await self.api.create(template=self.task, timeout_s=600)
            lv.op("create", (time.perf_counter() - t0) * 1000)
            made.append(sbx)
            for _ in range(EPISODE_CMDS):
                await self._timed(lv, "exec", lambda: self.api.run(sbx, STEP))
            t0 = time.perf_counter()
            children, errors, _ = await self.api.fork(sbx.sandbox_id, 2)
            lv.op("fork", (time.perf_counter() - t0) * 1000)
            made += children
            if errors:
                raise BenchError(f"fork: {errors[0]}")

            async def work(child: Sbx) -> None:
                for _ in range(CHILD_CMDS):
                    await self._timed(lv, "exec", lambda: self.api.run(child, STEP))

            await asyncio.gather(*(work(c) for c in children))
        finally:
            t0 = time.perf_counter()
            await asyncio.gather(
                *(self.api.kill(s.sandbox_id) for s in made), return_exceptions=True
            )
            lv.op("kill", (time.perf_counter() - t0) * 1000)
