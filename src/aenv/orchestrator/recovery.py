"""Start-up after a restart or a crash (`kill -9`): the catalog's records and what the
runtime still holds are made to agree, and what no record owns any more is removed.

* A record whose container survived gets it back, frozen or thawed as the record says (a
  crash may fall between a freeze or thaw and the save of its record).
* A record with an operation in flight (`SandboxRecord.pending`: a snapshot, fork, pause
  or hibernation cut short) never keeps a container that operation stopped: a sandbox
  whose container still runs goes on as it was; one whose memory image is whole comes back
  hibernated on it; one whose files are intact comes back paused with its files; only one
  with neither is lost. A snapshot the operation had not registered is dropped.
* Frozen sandboxes whose container is gone (the host rebooted) keep their files (paused,
  files only); running ones are lost, as before.
* Removed: the upper dirs and layer references of sandboxes the catalog does not know
  (creates and warm-pool boots a crash cut short), leftover generations and overlay work
  dirs, memory images nothing refers to (what an operation cut short wrote, a snapshot it
  had not registered), and fork snapshots (never seen by anyone).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from ..domain import (
    Instance,
    PausedState,
    PauseTier,
    PendingOp,
    SandboxRecord,
    SandboxState,
    TemplateKind,
)
from ..runtime.base import Runtime
from . import eventrecords as ev
from .boot import Booter
from .context import NodeContext
from .events import Events
from .storage import SandboxStorage
from .table import SandboxTable
from .templates import TemplateRegistry

log = logging.getLogger("aenv.orchestrator")

_LIVE = (SandboxState.RUNNING, SandboxState.PAUSED)
_ON_DISK = (PauseTier.HIBERNATED, PauseTier.FILES)


@dataclass
class Recovery:
    ctx: NodeContext
    table: SandboxTable
    runtime: Runtime
    booter: Booter
    storage: SandboxStorage
    templates: TemplateRegistry
    events: Events
    # Containers recovery itself removed (stopped ones kept only for their slot).
    _released: set[str] = field(default_factory=set, init=False)

    async def run(self) -> None:
        self._released.clear()
        records = await self.table.stored()
        keep = {r.instance.id for r in records if r.instance and r.state in _LIVE}
        recovered = await self.runtime.start(keep)
        kept: list[SandboxRecord] = []
        for r in records:
            if r.state in (SandboxState.KILLING, SandboxState.KILLED):
                await self._finish_kill(r)
                continue
            found = recovered.get(r.instance.id) if r.instance else None
            if r.state in _LIVE:
                await self._settle(r, found)
            else:
                r.instance, r.pending = None, None
            self.table.add(r)
            await self.table.save(r)
            kept.append(r)
        # A container kept for a record that names another one (an operation cut between
        # replacing the container and saving the record) belongs to nobody now.
        owned = {r.instance.id for r in kept if r.instance is not None} | self._released
        for cid, inst in recovered.items():
            if cid not in owned:
                log.info("removing container %s: no sandbox uses it", cid)
                await self.booter.destroy_quietly(inst)
        await self._drop_fork_snapshots()  # after: a fork's parent may take its image over
        await self._sweep(kept)
        await asyncio.to_thread(self.storage.layers.clean_staging)  # adds a crash cut short

    async def _settle(self, r: SandboxRecord, found: Instance | None) -> None:
        op, r.pending = r.pending, None
        stopped = found is not None and self.runtime.is_stopped(found)
        if found is not None and not stopped and await self._adopt(r, found):
            if op is not None:  # its image, partial or not registered, goes with the sweep
                log.info("sandbox %s: its %s was cut short; it goes on", r.sandbox_id, op.kind)
            return
        if found is not None:  # stopped by an operation (kept only for its slot), or broken
            self._released.add(found.id)
            await self.booter.destroy_quietly(found)
        r.instance = None
        if r.tier in _ON_DISK:
            return  # durable on disk; nothing was running
        if op is None and not stopped and r.state is SandboxState.RUNNING:
            self._lose(r, "it was running when the server stopped and could not be recovered")
            return
        image = op.image if op is not None else None
        whole = image is not None and self.runtime.image_complete(self.storage.image_dir(image))
        if not await asyncio.to_thread(self._files_back, r, op, whole):
            self._lose(r, "its files were not found after the server stopped")
            return
        now = self.ctx.now()
        # One the node put on disk from standby stays running to its user.
        standby = r.paused is not None and r.paused.standby
        if whole:
            assert image is not None
            image = await self._own_image(image)
            r.paused = PausedState(PauseTier.HIBERNATED, now, image=image, standby=standby)
        else:
            r.paused = PausedState(PauseTier.FILES, now, standby=standby)
        r.state = SandboxState.PAUSED
        what = "its container did not survive" if op is None else f"its {op.kind} was cut short"
        log.warning("sandbox %s: %s; it is paused (%s)", r.sandbox_id, what, r.paused.tier)

    async def _adopt(self, r: SandboxRecord, inst: Instance) -> bool:
        """Takes the surviving container back, frozen if the record is; False if it cannot
        be put in that state (it is then treated as gone)."""
        want_frozen = r.tier is PauseTier.FROZEN
        try:
            if await self.runtime.is_frozen(inst) != want_frozen:
                if want_frozen:
                    await self.runtime.freeze(inst)
                else:
                    await self.runtime.thaw(inst)
        except Exception as e:
            how = "frozen" if want_frozen else "thawed"
            log.warning("sandbox %s: its container could not be %s: %s", r.sandbox_id, how, e)
            return False
        r.instance = inst
        await self._reapply_egress(r)
        log.info("recovered sandbox %s (%s)", r.sandbox_id, r.tier or r.state)
        return True

    async def _reapply_egress(self, r: SandboxRecord) -> None:
        """The slot kept its rules, but not what the server itself serves for them (the
        egress proxy of domain rules and header transforms): put the record's policy in force again."""
        if not r.egress.proxied or r.instance is None:
            return
        try:
            await self.runtime.set_egress(r.instance, r.egress)
        except Exception as e:
            # Fail closed: the slot's own rules still send 80/443 to a proxy not there.
            log.warning("egress rules of recovered sandbox %s: %s", r.sandbox_id, e)

    def _files_back(self, r: SandboxRecord, op: PendingOp | None, seal: bool) -> bool:
        """Makes sure the record names the sandbox's files: its upper (sealed into a layer
        first when `seal`, as a hibernation leaves it), or the layer a seal the crash cut
        short had already moved it into. False when they are gone."""
        if r.upper is None:
            return True
        self.storage.attach_disk(r.sandbox_id, r.disk_mb)
        upper = Path(r.upper)
        planned = op.layer if op is not None else None
        if planned is not None and planned not in r.layers and self.storage.layers.has(planned):
            # Sealed, the record not saved after it: nothing ran on the upper since (the
            # seal's new one may even have the old one's path).
            self._add_layer(r, planned, fresh=not upper.is_dir() or any(upper.iterdir()))
            return True
        if upper.is_dir():
            if seal and any(upper.iterdir()):
                self._add_layer(r, self.storage.seal(upper, r.sandbox_id, planned), fresh=True)
            return True
        return False

    def _add_layer(self, r: SandboxRecord, digest: str, *, fresh: bool) -> None:
        r.layers = [digest, *r.layers]
        self.storage.hold("sandbox", r.sandbox_id, [digest])
        if fresh:
            r.upper = str(self.storage.new_upper(r.sandbox_id))

    async def _own_image(self, image: str) -> str:
        """A hibernation image of the sandbox's own from the operation's image (hard links:
        a snapshot that was registered keeps its own; an unregistered one goes with the
        sweep, once the record names the new one)."""
        if image.startswith("hib-"):
            return image
        name = f"hib-{image}-{secrets.token_hex(4)}"
        await self.templates.link_image(self.storage.image_dir(image), name)
        return name

    async def _finish_kill(self, r: SandboxRecord) -> None:
        """A kill the crash cut short (its container, not kept, is gone already)."""
        await self.table.delete(r)
        await self.booter.forget(r)
        if r.paused is not None and r.paused.image:
            await self.templates.drop_image(r.paused.image)
        log.info("sandbox %s: its kill was cut short; it is gone", r.sandbox_id)
        # Its killed event was not recorded yet (it is, once a kill is done).
        self.events.record(ev.KILLED, r, kill_reason=ev.KILL_UNKNOWN)

    def _lose(self, r: SandboxRecord, why: str) -> None:
        r.state = SandboxState.LOST
        r.instance = None
        r.note = why
        log.warning("sandbox %s lost across the restart", r.sandbox_id)
        self.events.record(ev.KILLED, r, kill_reason=ev.KILL_LOST, cause=why)

    async def _drop_fork_snapshots(self) -> None:
        for t in await self.templates.all():
            if t.kind is TemplateKind.SNAPSHOT and t.internal and t.fork_of:
                log.info("removing snapshot %s of a fork cut short", t.template_id)
                await self.templates.delete(t)

    def _hold_layers(self, records: list[SandboxRecord]) -> None:
        for r in records:
            self.storage.hold("sandbox", r.sandbox_id, [*r.copied_as, *r.layers])

    async def _sweep(self, records: list[SandboxRecord]) -> None:
        uppers = {r.sandbox_id: (r.upper, r.instance.id if r.instance else None) for r in records}
        used = {t.checkpoint for t in await self.templates.all() if t.checkpoint}
        used |= {r.paused.image for r in records if r.paused is not None and r.paused.image}
        dirs = await asyncio.to_thread(self.storage.sweep_uppers, uppers)
        images = await asyncio.to_thread(self.storage.sweep_images, {u for u in used if u})
        holds = await asyncio.to_thread(self.storage.sweep_holds, set(uppers))
        # Layer references are not fsynced (images/cache.py): a host crash may have lost the
        # last ones, so each sandbox's are taken again (templates' are, by `Templates.start`).
        await asyncio.to_thread(self._hold_layers, records)
        if dirs or images or holds:
            log.info(
                "start-up sweep: %d leftover upper dirs, %d memory images, %d layer holds",
                dirs,
                images,
                holds,
            )
