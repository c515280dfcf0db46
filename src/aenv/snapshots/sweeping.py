"""Mark and sweep over the repository: objects no manifest references are deleted.

A sweep lists every manifest (mark), then deletes the unreferenced layer and image objects
that are either named as candidates (the objects of a manifest just deleted or replaced) or
older than a grace period (leftovers of a crashed publish, which another node may still be
writing right now).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from .errors import ArtifactError

if TYPE_CHECKING:
    from .context import StoreContext

log = logging.getLogger("aenv.snapshots.store")

LAYERS = "layers"
IMAGES = "images"


class SweepGuard:
    """Many publishes at once, or one sweep alone (in this process): a sweep must not delete
    an object a concurrent publish just decided to reuse."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._publishing = 0
        self._sweeping = False

    @contextlib.asynccontextmanager
    async def publishing(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._sweeping)
            self._publishing += 1
        try:
            yield
        finally:
            async with self._cond:
                self._publishing -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def sweeping(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._sweeping and self._publishing == 0)
            self._sweeping = True
        try:
            yield
        finally:
            async with self._cond:
                self._sweeping = False
                self._cond.notify_all()


async def sweep(ctx: StoreContext, candidates: set[str], *, grace: float) -> list[str]:
    """Deletes unreferenced objects in `candidates` or older than `grace` seconds; returns
    their keys. Does nothing while any manifest is unreadable (it might reference them)."""
    async with ctx.guard.sweeping():
        try:
            manifests = await ctx.all_manifests(strict=True)
        except ArtifactError as e:
            log.error("not sweeping the repository: a manifest is unreadable: %s", e)
            return []
        referenced = {o.key for m in manifests for o in m.objects()}
        now = time.time()
        doomed: list[str] = []
        for prefix in (LAYERS, IMAGES):
            for o in await ctx.repository.list(prefix):
                if o.key in referenced:
                    continue
                if o.key in candidates or now - o.last_modified >= grace:
                    doomed.append(o.key)
        for key in doomed:
            await ctx.repository.delete(key)
        if doomed:
            log.info("swept %d unreferenced objects", len(doomed))
        return doomed
