"""Snapshots: a running (or paused) sandbox's files, memory and processes as a template.

A snapshot checkpoints the sandbox, seals its upper into a read-only layer and restores it
on a fresh upper over the new stack, in its own network slot (same id, address and
processes). The snapshot is then a template: that layer stack + the checkpoint image.

A filesystem snapshot (E2B `memory: false`) is only the files: a copy of the upper over the
sandbox's layers, no image; the sandbox is frozen for the copy, not checkpointed, and a
sandbox created from it boots fresh on those files."""

from __future__ import annotations

import asyncio
import builtins
import logging
import re
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import crashpoint
from ..domain import (
    BuildInfo,
    Instance,
    PauseTier,
    PendingOp,
    SandboxRecord,
    SandboxState,
    TemplateKind,
    TemplateRecord,
    Timings,
    new_id,
)
from ..errors import BadRequest, Conflict
from ..images.layers import LayerError
from ..runtime.base import Runtime
from . import eventrecords as ev
from .boot import Booter
from .context import NodeContext
from .events import Events
from .logs import SandboxLogs
from .nodeinfo import NodeStats
from .table import SandboxTable
from .templates import TemplateRegistry

log = logging.getLogger("aenv.orchestrator")

# Brings a snapshotted sandbox back (when the caller asked to run that later).
Restore = Coroutine[Any, Any, None]


@dataclass
class Snapshotter:
    ctx: NodeContext
    table: SandboxTable
    booter: Booter
    runtime: Runtime
    templates: TemplateRegistry
    stats: NodeStats
    logs: SandboxLogs
    events: Events

    async def snapshot(
        self,
        sandbox_id: str,
        name: str | None = None,
        timings: Timings | None = None,
        *,
        template_id: str | None = None,
        parent: str | None = None,
        build: BuildInfo | None = None,
        fork_of: str | None = None,
        internal: bool = False,
        memory: bool = True,
    ) -> TemplateRecord:
        """Makes a template of the sandbox's files, memory and processes (`memory=False`: of
        its files only); it keeps running. `template_id` (a template build) names the result
        instead of a new snapshot id; `internal`: neither listed nor published (a build
        registers it again as its template). Counted; logged unless internal."""
        await self.ctx.wake(sandbox_id)  # a napping sentry would checkpoint slower
        with self.stats.observe("snapshot", sandbox_id):
            rec = await self._snapshot(
                sandbox_id,
                name,
                timings or Timings(),
                template_id=template_id,
                parent=parent,
                build=build,
                fork_of=fork_of,
                internal=internal,
                memory=memory,
            )
        if not internal:
            self.logs.note(sandbox_id, "snapshot taken", snapshotID=rec.template_id)
            r = self.table.find(sandbox_id)
            if r is not None:
                self.events.record(
                    ev.CHECKPOINTED,
                    r,
                    snapshot_id=rec.template_id,
                    mode="full" if memory else "filesystem",
                )
        return rec

    async def _snapshot(
        self,
        sandbox_id: str,
        name: str | None,
        t: Timings,
        *,
        template_id: str | None,
        parent: str | None,
        build: BuildInfo | None,
        fork_of: str | None,
        internal: bool,
        memory: bool,
    ) -> TemplateRecord:
        self.table.get(sandbox_id)
        if name is not None:
            check_name(name)
            if await self.templates.find(name) is not None:
                raise Conflict(f"a template or snapshot named {name!r} already exists")
        async with self.table.lock(sandbox_id):
            r = self.table.get(sandbox_id)
            if not memory:
                return await self.take_files(
                    r,
                    t,
                    names=[name] if name else [],
                    snap_id=template_id,
                    parent=parent,
                    build=build,
                    fork_of=fork_of,
                    internal=internal,
                )
            snap, _ = await self.take(
                r,
                t,
                names=[name] if name else [],
                snap_id=template_id,
                parent=parent,
                build=build,
                fork_of=fork_of,
                internal=internal,
            )
        return snap

    async def take_files(
        self,
        r: SandboxRecord,
        t: Timings,
        *,
        names: builtins.list[str],
        internal: bool = False,
        snap_id: str | None = None,
        parent: str | None = None,
        build: BuildInfo | None = None,
        fork_of: str | None = None,
    ) -> TemplateRecord:
        """A filesystem snapshot (the sandbox's lock held): its layers plus a copy of its
        upper. A running sandbox is frozen only while the upper is copied, so the files are
        those of one instant; a paused one (any tier) is left as it is. The sandbox's own
        record does not change: it goes on writing into the same upper."""
        running = r.state is SandboxState.RUNNING
        if not running and r.state is not SandboxState.PAUSED:
            raise Conflict(f"sandbox {r.sandbox_id!r} cannot be snapshotted while {r.state}")
        storage = self.booter.storage
        layers = list(r.layers)
        if r.upper is not None:
            inst = r.instance if running else None
            if r.instance is None:  # files only or hibernated: no container holds its disk
                await asyncio.to_thread(storage.attach_disk, r.sandbox_id, r.disk_mb)
            if inst is not None:
                with t.stage("freeze"):
                    await self.runtime.freeze(inst)
            try:
                with t.stage("copy"):
                    top = await asyncio.to_thread(storage.copy_upper, Path(r.upper), r.sandbox_id)
            finally:
                if inst is not None:
                    with t.stage("thaw"):
                        await self.runtime.thaw(inst)
            if top is not None:
                layers.insert(0, top)
        snap = self._record(
            r,
            snap_id or new_id("s"),
            layers,
            checkpoint=None,
            names=names,
            internal=internal,
            parent=parent,
            build=build,
            fork_of=fork_of,
        )
        # Booted fresh, a sandbox made from it gets its environment from /init: the source's
        # own variables travel with the template's (a memory snapshot keeps them in envd).
        snap.env = {**r.boot.env, **r.env_vars}
        snap.envd_token = ""
        await self.templates.register(snap)
        return snap

    async def take(
        self,
        r: SandboxRecord,
        t: Timings,
        *,
        names: builtins.list[str],
        internal: bool = False,
        snap_id: str | None = None,
        parent: str | None = None,
        build: BuildInfo | None = None,
        fork_of: str | None = None,
        boot_of: TemplateRecord | None = None,
        restore_later: bool = False,
        op: str = "snapshot",
    ) -> tuple[TemplateRecord, Restore | None]:
        """Checkpoints the sandbox (its lock held) and registers the snapshot; the sandbox is
        back when this returns, or (`restore_later`) when the returned coroutine has run:
        the snapshot is usable before that, so fork children restore while the parent does.
        `boot_of`: the template this is the boot snapshot of (its source is thrown away, so
        it is never saved); `op` names the operation for crash recovery."""
        snap_id = snap_id or new_id("s")
        back: Restore | None = None
        tier = r.tier
        kept = boot_of is None
        layers: builtins.list[str] | None = None  # else the record's, once sealed
        if kept and r.state is SandboxState.RUNNING and r.upper is not None:
            layers = await self._take_live(r, t, snap_id, op)
        elif r.state is SandboxState.RUNNING or tier is PauseTier.FROZEN:
            assert r.instance is not None
            inst = r.instance
            if kept:  # from here a crash leaves a checkpointed or stopped container
                seal_as = self.booter.storage.seal_digest(r.sandbox_id)
                r.pending = PendingOp(op, image=snap_id, layer=seal_as)
                await self.table.save(r)
            try:
                image = await self.templates.fresh_image(snap_id)
                if tier is PauseTier.FROZEN:
                    with t.stage("thaw"):
                        await self.runtime.thaw(inst)
                with t.stage("checkpoint"):
                    await self.runtime.checkpoint(inst, image, leave_running=False)
                crashpoint.hit("snapshot.checkpointed")
                with t.stage("stop"):
                    await self.runtime.stop(inst)
                crashpoint.hit("snapshot.stopped")
                await self.booter.seal(r, t)
                if kept:  # its new layers and upper (the restore writes into that upper)
                    await self.table.save(r)
                crashpoint.hit("snapshot.sealed")
                back = self._restore(
                    r,
                    t,
                    image,
                    inst,
                    refreeze=tier is PauseTier.FROZEN,
                    save=kept,
                    last=restore_later,
                )
                if not restore_later:
                    await back
                    back = None
            except BaseException:
                r.pending = None  # failed, not interrupted: nothing for a restart to finish
                raise
        elif tier is PauseTier.HIBERNATED:
            # Already on disk (hibernation sealed the files): the snapshot shares its image.
            assert r.paused is not None and r.paused.image is not None
            async with self.templates.hibernation_image(r.paused.image, r.sandbox_id) as src:
                await self.templates.link_image(src, snap_id)
        else:
            raise Conflict(f"sandbox {r.sandbox_id!r} cannot be snapshotted while {r.state}")
        snap = self._record(
            r,
            snap_id,
            list(r.layers) if layers is None else layers,
            checkpoint=snap_id,
            names=names,
            internal=internal,
            parent=parent,
            build=build,
            fork_of=fork_of,
        )
        if boot_of is not None:
            snap.boot_of = boot_of.template_id
            snap.boot_from_layers = list(boot_of.layers)
            snap.boot_run = self.ctx.run_id
        try:
            with t.stage("register"):
                await self.templates.register(snap)
            crashpoint.hit("snapshot.registered")
            if kept:
                if back is None:  # else the restore clears it
                    r.pending = None
                with t.stage("save"):
                    await self.table.save(r)
        except BaseException:
            if back is not None:
                await back  # the sandbox comes back all the same
            raise
        return snap, back

    async def _take_live(
        self, r: SandboxRecord, t: Timings, snap_id: str, op: str
    ) -> builtins.list[str]:
        """A running sandbox's snapshot without stopping it (its lock held): checkpointed
        leaving it running but held, its upper copied meanwhile (only what changed since
        its last live snapshot, if that copied the same upper), then let go. Its own record
        keeps its stack and upper; returns the snapshot's layer stack."""
        assert r.instance is not None and r.upper is not None
        inst, upper, storage = r.instance, Path(r.upper), self.booter.storage
        # A crash from here leaves the container running or held: recovery lets it go on
        # (a held one is `is_frozen`, thawed as a running record wants) and sweeps the image.
        r.pending = PendingOp(op, image=snap_id)
        with t.stage("prepare"):
            await self.table.save(r)
        try:
            with t.stage("image"):
                image = await self.templates.fresh_image(snap_id)
            try:
                with t.stage("checkpoint"):
                    await self.runtime.checkpoint(inst, image, leave_running=True, hold=True)
                crashpoint.hit("snapshot.checkpointed")
                since = r.copied_as if r.copied_upper == r.upper else []
                with t.stage("copy"):
                    copied = await asyncio.to_thread(self._copy, upper, r.sandbox_id, since)
                crashpoint.hit("snapshot.copied")
            finally:
                if await self.runtime.is_frozen(inst):
                    with t.stage("thaw"):
                        await self.runtime.thaw(inst)
        except BaseException:
            r.pending = None  # failed, not interrupted: nothing for a restart to finish
            raise
        if copied != r.copied_as:
            await asyncio.to_thread(storage.hold, "sandbox", r.sandbox_id, copied)
            old = [d for d in r.copied_as if d not in copied]
            if old:
                await asyncio.to_thread(storage.unhold, "sandbox", r.sandbox_id, old)
        r.copied_as, r.copied_upper = copied, r.upper
        return [*copied, *r.layers]

    # Live snapshots of one upper stack their changes; past this many layers the next one
    # copies the whole upper again, so no stack grows without end.
    MAX_COPY_CHAIN = 8

    def _copy(self, upper: Path, label: str, since: builtins.list[str]) -> builtins.list[str]:
        """The upper as layers (topmost first): its changes over `since`, or all of it."""
        storage = self.booter.storage
        if since and len(since) < self.MAX_COPY_CHAIN:
            try:
                top = storage.copy_upper_since(upper, label, since)
            except LayerError as e:  # a layer of the last copy was dropped meanwhile
                log.info("snapshot of %s copies its whole upper: %s", label, e)
            else:
                return since if top is None else [top, *since]
        whole = storage.copy_upper(upper, label)
        return [] if whole is None else [whole]

    def _record(
        self,
        r: SandboxRecord,
        snap_id: str,
        layers: builtins.list[str],
        *,
        checkpoint: str | None,
        names: builtins.list[str],
        internal: bool,
        parent: str | None,
        build: BuildInfo | None,
        fork_of: str | None,
    ) -> TemplateRecord:
        return TemplateRecord(
            template_id=snap_id,
            kind=TemplateKind.SNAPSHOT,
            layers=layers,
            names=names,
            internal=internal,
            checkpoint=checkpoint,
            env=dict(r.boot.env),
            user=r.boot.user,
            workdir=r.boot.workdir,
            cpu_count=r.cpu_count,
            memory_mb=r.memory_mb,
            created_at=self.ctx.now().isoformat(),
            parent=parent or r.template_id,
            sandbox_id=r.sandbox_id,
            envd_token=r.envd_access_token,
            env_vars=dict(r.env_vars),
            build=build or BuildInfo(),
            fork_of=fork_of,
            # The mounts, not the volumes' files: its sandboxes mount the same volumes.
            volume_mounts=list(r.volume_mounts),
        )

    async def _restore(
        self,
        r: SandboxRecord,
        t: Timings,
        image: Path,
        stopped: Instance,
        *,
        refreeze: bool,
        save: bool,
        last: bool,
    ) -> None:
        """Brings the sandbox back after its checkpoint; `save`: the record is saved with its
        new container, `last`: which ends the operation (the snapshot is registered)."""
        await self.booter.restore_in_place(r, t, image, stopped, "after a snapshot")
        crashpoint.hit("snapshot.restored")
        if refreeze:
            assert r.instance is not None
            await self.runtime.freeze(r.instance)
        if save:  # a crash from here finds the new container, not the stopped one
            if last:
                r.pending = None
            await self.table.save(r)


def check_name(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}", name):
        raise BadRequest(
            f"invalid snapshot name {name!r}: use letters, digits and _.:/- (max 128 chars)"
        )
