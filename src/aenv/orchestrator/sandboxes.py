"""Creating and ending sandboxes: create (from the warm pool, a boot snapshot, a snapshot's
memory image, or a cold boot), kill, timeouts, and exporting a sandbox's files as layers."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

from .. import crashpoint
from ..domain import (
    CreateRequest,
    EgressPolicy,
    SandboxRecord,
    SandboxState,
    TemplateRecord,
    Timings,
    VolumeMount,
)
from ..errors import BadRequest, NotFound, Unavailable
from ..logctx import about
from ..runtime.base import Runtime
from ..runtime.bundle import MOUNT as ENVD_MOUNT
from ..volumes import VolumeStore
from . import eventrecords as ev
from .boot import Booter
from .bootsnaps import BootSnapshots
from .context import NodeContext, check_timeout
from .events import Events
from .logs import SandboxLogs
from .nodeinfo import NodeStats
from .pool import WarmPool
from .storage import SandboxStorage
from .table import SandboxTable
from .templates import TemplateRegistry

_GONE = (SandboxState.KILLED, SandboxState.KILLING)
# Where no volume may be mounted: what every sandbox needs there would be hidden.
RESERVED_PATHS = ("/proc", "/dev", "/sys", ENVD_MOUNT)


@dataclass
class Sandboxes:
    ctx: NodeContext
    table: SandboxTable
    booter: Booter
    templates: TemplateRegistry
    pool: WarmPool
    boot_snapshots: BootSnapshots
    runtime: Runtime
    storage: SandboxStorage
    volumes: VolumeStore
    logs: SandboxLogs
    stats: NodeStats
    events: Events

    async def create(
        self, req: CreateRequest, timings: Timings | None = None, *, admitted: bool = False
    ) -> SandboxRecord:
        """A new running sandbox, counted and logged as created, a fork's children too.
        `admitted`: the boot queue was checked for it already (a fork's children, all at
        once)."""
        with self.stats.observe("create"):
            r = await self._create(req, timings or Timings(), admitted)
        self.logs.note(
            r.sandbox_id,
            "sandbox created",
            template=r.template_id,
            cpuCount=r.cpu_count,
            memoryMB=r.memory_mb,
        )
        self.events.record(ev.CREATED, r)
        return r

    async def _create(self, req: CreateRequest, t: Timings, admitted: bool) -> SandboxRecord:
        self.ctx.check_taking()
        s = self.ctx.settings
        tpl = await self.templates.get(req.template_id)
        if req.standby_after is None and tpl.standby_after is not None:
            req = replace(req, standby_after=tpl.standby_after)
        timeout = s.default_timeout if req.timeout is None else req.timeout
        check_timeout(timeout, s)
        if tpl.has_memory:
            # A snapshot carries memory: the sandbox continues from it with its recorded size.
            cpu, mem = (
                int(tpl.cpu_count or s.default_cpu_count),
                int(tpl.memory_mb or s.default_memory_mb),
            )
        else:
            cpu = req.cpu_count or tpl.cpu_count or s.default_cpu_count
            mem = req.memory_mb or tpl.memory_mb or s.default_memory_mb
        if not admitted:
            self.table.check_quota(req.owner, mem)
        names = tpl.names
        alias = req.template_id if req.template_id in names else (names[0] if names else None)
        mounts = await self._mounts(tpl, req)
        # Pre-booted sandboxes and boot snapshots have no volumes: one with some boots cold.
        warm = None if mounts else self.pool.take(tpl, cpu, mem)
        if warm is not None:
            about(warm.sandbox_id)
            adopted = await self.pool.adopt(warm, req, alias, timeout, t)
            if adopted is not None:
                return adopted
        if not admitted:
            self.booter.check_queue()
        self.check_free_disk()
        await self.table.admit(mem)
        boot = None if mounts else self.boot_snapshots.for_shape(tpl, cpu, mem)
        r = self.booter.new_record(
            tpl,
            req,
            alias=alias,
            timeout=timeout,
            cpu=cpu,
            mem=mem,
            layers=None if boot is None else boot.layers,
        )
        r.volume_mounts = mounts
        self.table.add(r)
        about(r.sandbox_id)

        # A fresh context per use: a @contextmanager object can be entered only once.
        def fetching() -> contextlib.AbstractContextManager[None]:
            return t.stage("fetch") if self.templates.has_repository else contextlib.nullcontext()

        try:
            await asyncio.to_thread(self.storage.hold, "sandbox", r.sandbox_id, r.layers)
            with fetching():
                await self.templates.ensure_layers(tpl)
            if tpl.has_memory:
                with fetching():
                    image = await self.templates.image_of(tpl)
                await self.booter.boot(r, t, image=image, init_from=tpl.envd_token or None)
            elif boot is not None:
                image = self.templates.local_image(boot)
                await self.booter.boot(r, t, image=image, init_from=boot.envd_token or None)
            else:
                await self.booter.boot(r, t)
            crashpoint.hit("create.booted")
        except BaseException:
            self.table.discard(r.sandbox_id)
            await self.booter.forget(r)
            raise
        r.state = SandboxState.RUNNING
        # The clock starts at readiness, so a slow boot doesn't eat the user's timeout.
        r.end_at = self.ctx.now() + timedelta(seconds=timeout)
        await self.table.save(r)
        self.booter.squash_later(r)
        return r

    async def _mounts(self, tpl: TemplateRecord, req: CreateRequest) -> builtins.list[VolumeMount]:
        """The volumes the new sandbox mounts: the request's, checked before anything
        boots; from a snapshot, the snapshot's own (its processes may hold files open there,
        and a checkpoint restores only with the mounts it was taken with)."""
        wanted: builtins.list[VolumeMount] = []
        if req.volume_mounts:
            wanted = await asyncio.to_thread(
                self.volumes.resolve, req.volume_mounts, RESERVED_PATHS
            )
        if tpl.has_memory and wanted and wanted != tpl.volume_mounts:
            have = ", ".join(f"{m.name} at {m.path}" for m in tpl.volume_mounts) or "none"
            raise BadRequest(
                f"{req.template_id!r} is a snapshot: its sandboxes mount the volumes it was "
                f"taken with ({have}); leave volumeMounts out or give the same"
            )
        if wanted or not tpl.volume_mounts:
            return wanted
        await asyncio.to_thread(self.volumes.check_present, tpl.volume_mounts)
        return list(tpl.volume_mounts)

    def check_free_disk(self) -> None:
        """Admission: a node short of disk refuses new sandboxes rather than have them fail
        their first writes (a statvfs: no I/O to speak of)."""
        s = self.ctx.settings
        st = os.statvfs(s.home)
        free_mb = st.f_bavail * st.f_frsize // 2**20
        if free_mb < s.min_free_disk_mb:
            raise Unavailable(
                f"not enough free disk on this node: {free_mb} MiB free, "
                f"{s.min_free_disk_mb} MiB needed to start a sandbox"
            )

    async def kill(self, sandbox_id: str) -> None:
        """A user's kill, counted as one."""
        # Out of standby (frozen tasks die only thawed); one on disk is killed there.
        await self.ctx.wake(sandbox_id, restore=False)
        with self.stats.observe("kill", sandbox_id):
            await self.end(sandbox_id, ev.KILL_REQUEST)

    async def end(self, sandbox_id: str, reason: str) -> None:
        """Kills the sandbox for the node itself (its timeout ran out, its files exported):
        not counted as a user's kill, nothing woken. `reason`: the killed event's
        `kill_reason`."""
        r = self.table.find(sandbox_id)
        if r is None or r.state in (*_GONE, SandboxState.CREATING):
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        async with self.table.lock(sandbox_id):
            if r.state in _GONE:
                raise NotFound(f"sandbox {sandbox_id!r} not found")
            r.state = SandboxState.KILLING
            await self.table.save(r)  # a crash from here: recovery finishes the kill
            if r.instance:
                await self.booter.destroy_quietly(r.instance)
            r.state = SandboxState.KILLED
            r.instance = None
            await self.table.delete(r)
            await self.booter.forget(r)
            if r.paused is not None and r.paused.image:
                await self.templates.drop_image(r.paused.image)
        self.events.record(ev.KILLED, r, kill_reason=reason, execution=self.events.execution(r))

    async def set_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord:
        self.ctx.touch(sandbox_id)
        r = self.table.get(sandbox_id)
        check_timeout(timeout, self.ctx.settings)
        r.end_at = self.ctx.now() + timedelta(seconds=timeout)
        await self.table.save(r)
        self.events.record(ev.UPDATED, r, set_timeout=ev.iso(r.end_at))
        return r

    async def update_network(self, sandbox_id: str, policy: EgressPolicy) -> SandboxRecord:
        """Replaces the sandbox's egress rules: in force at once on a running or frozen one,
        at its next boot otherwise (every boot puts the record's rules in place first).
        Placeholders name the secrets of the sandbox's owner, whoever sends the update; a
        running sandbox given its first header transforms gets the egress CA installed."""
        r = self.table.get(sandbox_id)
        policy = replace(policy, owner=r.owner)
        trust = policy.intercepts and not r.egress.intercepts
        if trust and r.state is SandboxState.RUNNING:
            await self.ctx.wake(sandbox_id)  # out of a nap or standby: envd must answer
        async with self.table.lock(sandbox_id):
            r = self.table.get(sandbox_id)
            if r.instance is not None:
                await self.runtime.set_egress(r.instance, policy)
            r.egress = policy
            await self.table.save(r)
            if trust and r.instance is not None and r.state is SandboxState.RUNNING:
                await self.booter.trust_egress_ca(r)
        self.events.record(
            ev.UPDATED,
            r,
            network_egress={
                "allowed_cidrs": policy.allow_cidrs,
                "denied_cidrs": policy.deny_cidrs,
                "allowed_domains": [e for e in policy.allow_out if e not in policy.allow_cidrs],
                "denied_domains": [e for e in policy.deny_out if e not in policy.deny_cidrs],
                "allow_internet_access": policy.allow_internet,
            },
        )
        return r

    async def refresh(self, sandbox_id: str, duration: int | None) -> SandboxRecord:
        self.ctx.touch(sandbox_id)
        r = self.table.get(sandbox_id)
        d = self.ctx.settings.default_timeout if duration is None else duration
        if d < 0 or d > 3600:
            raise BadRequest("duration must be between 0 and 3600 seconds")
        end_at = max(r.end_at, self.ctx.now() + timedelta(seconds=d))
        changed, r.end_at = end_at != r.end_at, end_at
        await self.table.save(r)
        if changed:
            self.events.record(ev.UPDATED, r, set_timeout=ev.iso(r.end_at))
        return r

    async def export_layers(self, sandbox_id: str) -> builtins.list[str]:
        """Ends the sandbox and returns its files as a layer stack (topmost first): the
        upper is sealed into a new layer on top of the ones it ran on. Template builds
        commit each step this way."""
        self.table.get(sandbox_id)
        async with self.table.lock(sandbox_id):
            r = self.table.get(sandbox_id)
            if r.instance:
                await self.runtime.sync_files(r.instance)
                await self.runtime.destroy(r.instance)
                r.instance = None
            assert r.upper is not None
            digest = await asyncio.to_thread(self.storage.seal, Path(r.upper), r.sandbox_id)
            layers = [digest, *r.layers]
            r.upper = None
        await self.end(sandbox_id, ev.KILL_BUILD)
        return layers
