"""The `rollouts` episode done with raw runsc (the baseline of `rollouts.py`): the same task
snapshot (a checkpoint of a prepared container), and per episode a restore of it over a copy
of its files, 10 `runsc exec`, a `checkpoint --leave-running` and two restores of that (each
over a copy of the parent's files) with 3 `runsc exec` each, then the three killed."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from .baseline import RawRunsc
from .cpu import CpuMeter
from .raw_runsc import NET_PREFIX, Ctr
from .rollouts import (
    CHILD_CMDS,
    EPISODE_CMDS,
    MEMORY_MB,
    STEP,
    TASK_SETUP,
    Level,
    levels,
    run_level,
)
from .rollouts import record as record_level


class RawRollouts:
    def __init__(self, raw: RawRunsc) -> None:
        self.raw = raw
        self.task_image: Path | None = None
        self.task_upper: Path | None = None

    async def run(self) -> None:
        raw = self.raw
        raw.progress.step("baseline rollouts: task snapshot", 1)
        source = await raw.fresh(MEMORY_MB)
        try:
            await raw.exec(source, TASK_SETUP)
            self.task_image = await asyncio.to_thread(raw.image)
            await raw.checkpoint(source, self.task_image, leave_running=True)
            self.task_upper = await asyncio.to_thread(raw.copy_upper, source.upper)
        finally:
            await raw.destroy(source)
            raw.progress.advance()
        meter = CpuMeter(NET_PREFIX)
        try:
            for at_once, count in levels(raw.plan):
                raw.progress.step(f"baseline rollouts: {count} episodes, {at_once} at once", count)
                lv = await run_level(at_once, count, self.episode, meter, raw.progress)
                record_level(raw.results, lv, baseline=True, health=None)
        finally:
            if self.task_image is not None:
                await asyncio.to_thread(shutil.rmtree, self.task_image, True)

    async def _restore(self, image: Path, upper: Path) -> Ctr:
        copy = await asyncio.to_thread(self.raw.copy_upper, upper)
        ctr, _ = await self.raw.launch(await self.raw.slot(), MEMORY_MB, image=image, upper=copy)
        return ctr

    async def episode(self, lv: Level) -> None:
        raw = self.raw
        assert self.task_image is not None and self.task_upper is not None
        made: list[Ctr] = []
        image: Path | None = None
        try:
            ctr = await self._restore(self.task_image, self.task_upper)
            made.append(ctr)
            for _ in range(EPISODE_CMDS):
                lv.op("exec", await raw.exec(ctr, STEP))
            image = await asyncio.to_thread(raw.image)
            lv.op("checkpoint", await raw.checkpoint(ctr, image, leave_running=True))
            children = await asyncio.gather(*(self._restore(image, ctr.upper) for _ in range(2)))
            made += children

            async def work(child: Ctr) -> None:
                for _ in range(CHILD_CMDS):
                    lv.op("exec", await raw.exec(child, STEP))

            await asyncio.gather(*(work(c) for c in children))
        finally:
            await raw.destroy_all(made)
            if image is not None:
                await asyncio.to_thread(shutil.rmtree, image, True)
