"""Mark and sweep over the repository: objects no manifest references are deleted.

A sweep lists every manifest (mark), then deletes the unreferenced layer and image objects
that are either named as candidates (the objects of a manifest just deleted or replaced) or
older than a grace period (leftovers of a crashed publish, which another node may still be
writing right now).
"""

from __future__ import annotations

import logging
import time

from .context import StoreContext
from .errors import ArtifactError

log = logging.getLogger("aenv.snapshots.store")

LAYERS = "layers"
IMAGES = "images"


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
