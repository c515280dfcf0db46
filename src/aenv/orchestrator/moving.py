"""Sandboxes leaving and joining this node, for a cluster: drain (hibernate and publish every
sandbox so it can resume elsewhere), release (forget a published sandbox another node takes
over) and adopt (take over a sandbox another node hibernated, from the shared repository,
under the same id). The gateway decides; the node only does."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

from ..domain import (
    LIVE_STATES,
    PausedState,
    PauseTier,
    SandboxRecord,
    SandboxState,
)
from ..errors import AenvError, Conflict, NotFound
from . import eventrecords as ev
from .boot import Booter
from .context import NodeContext
from .events import Events
from .pausing import Pauser
from .storage import SandboxStorage
from .table import SandboxTable
from .templates import TemplateRegistry

log = logging.getLogger("aenv.orchestrator")

# Sandboxes hibernated and uploaded at once while draining (each one is disk and network).
DRAIN_CONCURRENCY = 2


@dataclass(frozen=True)
class DrainResult:
    sandbox_id: str
    published: bool
    error: str | None = None


@dataclass
class Mover:
    ctx: NodeContext
    table: SandboxTable
    booter: Booter
    pauser: Pauser
    templates: TemplateRegistry
    storage: SandboxStorage
    events: Events

    async def drain(self) -> list[DrainResult]:
        """Takes no more creates and puts every sandbox into the repository (running ones
        are paused first): each resumes on whichever node its next resume reaches."""
        if not self.templates.has_repository:
            raise Conflict("this node has no snapshot repository: nothing can move off it")
        self.ctx.draining = True
        gate = asyncio.Semaphore(DRAIN_CONCURRENCY)

        async def one(sandbox_id: str) -> DrainResult:
            async with gate:
                try:
                    ok = await self.pauser.publish_now(sandbox_id)
                except AenvError as e:
                    return DrainResult(sandbox_id, False, e.message)
                except Exception as e:
                    log.exception("draining sandbox %s failed", sandbox_id)
                    return DrainResult(sandbox_id, False, str(e))
                return DrainResult(sandbox_id, ok, None if ok else "it could not be published")

        ids = [r.sandbox_id for r in self.table.all() if r.state in LIVE_STATES]
        return list(await asyncio.gather(*(one(i) for i in ids)))

    def undrain(self) -> None:
        self.ctx.draining = False

    async def release(self, sandbox_id: str) -> str:
        """Forgets a hibernated, published sandbox here (another node takes it over): the
        repository keeps its files and image. Returns the image's name."""
        async with self.table.lock(sandbox_id):
            r = self.table.get(sandbox_id)
            image = _movable_image(r)
            if image is None:
                raise Conflict(
                    f"sandbox {sandbox_id!r} cannot move: only a hibernated sandbox in the "
                    f"repository can (it is {r.state}{_tier(r)})"
                )
            await self.table.delete(r)
            await self.booter.forget(r)
            await asyncio.to_thread(self.storage.remove_image, image)
        log.info("sandbox %s released to another node", sandbox_id)
        return image

    async def adopt(self, sandbox_id: str, image: str) -> SandboxRecord:
        """Takes over a sandbox another node hibernated and published as `image`: paused
        here, its files fetched, its memory image fetched when it resumes."""
        async with self.table.lock(sandbox_id):
            found = self.table.find(sandbox_id)
            if found is not None and found.state in LIVE_STATES:
                return found  # a second gateway asked too
            rec = await self.templates.hibernation(image)
            if rec.sandbox_id != sandbox_id or rec.hibernated is None:
                raise NotFound(f"{image!r} is not a hibernation of sandbox {sandbox_id!r}")
            r = replace(rec.hibernated)
            await self.templates.ensure_layers(rec)
            paused_at = r.paused.paused_at if r.paused is not None else self.ctx.now()
            r.state = SandboxState.PAUSED
            # One that was running when its node drained stays running to its user here.
            standby = r.paused is not None and r.paused.standby
            r.paused = PausedState(
                PauseTier.HIBERNATED, paused_at, image=image, published=True, standby=standby
            )
            r.layers = list(rec.layers)
            r.instance = None
            r.pending = None
            r.retired_layers = []
            r.upper = str(self.storage.first_upper(sandbox_id))
            await asyncio.to_thread(self.storage.hold, "sandbox", sandbox_id, r.layers)
            self.table.add(r)
            await self.table.save(r)
        log.info("sandbox %s adopted from the repository (%s)", sandbox_id, image)
        self.events.record(ev.MOVED, r, node_id=self.ctx.settings.cluster_node_id)
        return r


def _movable_image(r: SandboxRecord) -> str | None:
    p = r.paused
    if r.tier is PauseTier.HIBERNATED and p is not None and p.published and p.image:
        return p.image
    return None


def _tier(r: SandboxRecord) -> str:
    return f", {r.tier.value}" if r.tier is not None else ""
