"""Rollback in place (docs/fork-tree.md): a running sandbox brought back to one of its own
memory snapshots — files, memory and processes — under the same id, address, tokens and
URLs, so a harness retries a step without re-wiring anything. The container is replaced by
one restored from the snapshot's image, on the snapshot's layers and a fresh upper; what the
sandbox wrote since is dropped."""

from __future__ import annotations

import asyncio
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..domain import SandboxState, Timings
from ..errors import BadRequest, Conflict
from . import eventrecords as ev
from .boot import Booter
from .context import NodeContext
from .events import Events
from .logs import SandboxLogs
from .nodeinfo import NodeStats
from .table import SandboxTable
from .templates import TemplateRegistry

log = logging.getLogger("aenv.orchestrator")


@dataclass
class Rollbacks:
    ctx: NodeContext
    table: SandboxTable
    booter: Booter
    templates: TemplateRegistry
    stats: NodeStats
    logs: SandboxLogs
    events: Events

    async def rollback(
        self, sandbox_id: str, snapshot: str, timings: Timings | None = None
    ) -> None:
        t = timings or Timings()
        await self.ctx.wake(sandbox_id)
        with self.stats.observe("rollback", sandbox_id):
            await self._rollback(sandbox_id, snapshot, t)
        self.logs.note(sandbox_id, "sandbox rolled back", snapshotID=snapshot)
        r = self.table.find(sandbox_id)
        if r is not None:
            self.events.record(ev.ROLLED_BACK, r, snapshot_id=snapshot)

    async def _rollback(self, sandbox_id: str, snapshot: str, t: Timings) -> None:
        snap = await self.templates.get_snapshot(snapshot)
        if snap.sandbox_id != sandbox_id:
            raise BadRequest(f"snapshot {snapshot!r} was not taken of sandbox {sandbox_id!r}")
        if not snap.checkpoint:
            raise BadRequest(
                f"snapshot {snapshot!r} holds files only: a rollback needs a memory snapshot"
            )
        async with self.table.lock(sandbox_id):
            r = self.table.get(sandbox_id)
            if r.state is not SandboxState.RUNNING or r.instance is None:
                raise Conflict(f"sandbox {sandbox_id!r} must be running to roll back")
            await self.templates.ensure_layers(snap)
            image = await self.templates.image_of(snap)
            storage = self.booter.storage
            old, old_layers, old_upper = r.instance, list(r.layers), r.upper
            await asyncio.to_thread(storage.hold, "sandbox", sandbox_id, list(snap.layers))
            with t.stage("stop"):
                # Killed at once, the rest of it (exit, unmount, delete, its network slot)
                # in the background: the restored one starts meanwhile in a fresh slot, as
                # a resume from disk does (the address inside is the same in every slot).
                await self.booter.destroy_quietly(old)
            r.instance = None
            r.layers = list(snap.layers)
            r.upper = str(await asyncio.to_thread(storage.new_upper, sandbox_id))
            r.copied_as, r.copied_upper = [], None
            await self.booter.restore_in_place(r, t, image, None, f"from snapshot {snapshot}")
            await self.table.save(r)
        gone = [d for d in old_layers if d not in r.layers]
        await asyncio.to_thread(storage.unhold, "sandbox", sandbox_id, gone)
        if old_upper is not None and old_upper != r.upper:
            # The whole generation (upper and the overlay's work dir) of what was dropped.
            await asyncio.to_thread(shutil.rmtree, Path(old_upper).parent, True)
        log.info("sandbox %s rolled back to %s", sandbox_id, snapshot)
