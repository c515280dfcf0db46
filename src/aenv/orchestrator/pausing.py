"""Pause tiers and the way back.

    frozen      the container is frozen in place: CPU released, memory kept; resume = thaw
    hibernated  memory + processes checkpointed to an image, files sealed, container and
                slot released; resume = restore the image over the same layers
    files       only the files are kept (E2B `memory: false`); resume = a fresh boot

A paused sandbox is frozen at once and hibernated after `hibernate_after` idle seconds (or
at a clean shutdown). A hibernated sandbox is published to the repository a few seconds
later; the node then keeps its memory image only in its bounded cache."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
from dataclasses import dataclass, field, replace
from datetime import timedelta

from .. import crashpoint
from ..config import Settings
from ..domain import (
    ENVD_PORT,
    LIVE_STATES,
    PausedState,
    PauseTier,
    PendingOp,
    SandboxRecord,
    SandboxState,
    TemplateKind,
    TemplateRecord,
    Timings,
    Upstream,
)
from ..errors import Conflict, Forbidden, SandboxNotFound, Unavailable
from ..logctx import sandbox_context
from ..runtime.base import Instance, Runtime
from . import eventrecords as ev
from .boot import Booter
from .context import NodeContext, check_timeout
from .events import Events
from .logs import SandboxLogs
from .nodeinfo import NodeStats
from .table import SandboxTable
from .templates import TemplateRegistry

log = logging.getLogger("aenv.orchestrator")

# Seconds a hibernated sandbox stays on the node's disk only before it is published.
PUBLISH_HIBERNATION_AFTER = 5.0
# Seconds a sandbox in standby on disk waits for memory to be restored into.
STANDBY_ROOM_PATIENCE = 30.0
# Seconds a strict pause (E2B `requireHealthyGuest`) waits for envd's health check.
GUEST_CHECK_TIMEOUT = 2.0
# The least timeout an auto-resume gives (E2B's docs: at least five minutes).
AUTO_RESUME_MIN_TIMEOUT = 300


def auto_resume_timeout(r: SandboxRecord, settings: Settings) -> int:
    """A sandbox woken by traffic runs for the timeout it was created with, counted from the
    resume and at least five minutes, as on E2B (a record from before the create's timeout
    was kept: the node's default)."""
    created = r.timeout if r.timeout is not None else settings.default_timeout
    return max(AUTO_RESUME_MIN_TIMEOUT, created)


@dataclass
class Pauser:
    ctx: NodeContext
    table: SandboxTable
    booter: Booter
    runtime: Runtime
    templates: TemplateRegistry
    stats: NodeStats
    logs: SandboxLogs
    events: Events
    _publishing: dict[str, asyncio.Task[bool]] = field(default_factory=dict, init=False)

    # ------------------------------------------------------------------ pause
    async def pause(
        self,
        sandbox_id: str,
        memory: bool = True,
        timings: Timings | None = None,
        *,
        require_healthy_guest: bool = False,
    ) -> None:
        """A user's pause of a running sandbox (`memory=False`: files only), counted and
        logged. `require_healthy_guest` (the SDK's `pause(strict=True)`): refused with 503,
        the sandbox left running, when its envd does not answer; otherwise envd is not asked
        (no tier here needs it)."""
        # envd's journal is not read first (a request into the sandbox would cost pause
        # more than the freeze): a frozen or hibernated envd keeps it for the next read
        # after resume; a paused sandbox's logs are those read before it paused.
        # A napping sentry would stop slower; one in standby on disk is paused there.
        await self.ctx.wake(sandbox_id, restore=False)
        with self.stats.observe("pause", sandbox_id):
            await self._pause(
                sandbox_id, memory, timings, require_healthy_guest=require_healthy_guest
            )
        self.logs.note(sandbox_id, "sandbox paused", memory=str(memory).lower())
        self._paused(sandbox_id, memory)

    async def auto_pause(self, sandbox_id: str, memory: bool) -> None:
        """The node's own pause of a sandbox whose timeout ran out (`autoPause`): not
        counted or logged as a user's (its event says `auto_pause`)."""
        await self._pause(sandbox_id, memory)
        self._paused(sandbox_id, memory, auto=True)

    def _paused(self, sandbox_id: str, memory: bool, *, auto: bool = False) -> None:
        r = self.table.find(sandbox_id)
        if r is None:
            return
        self.events.record(
            ev.PAUSED,
            r,
            execution=self.events.execution(r),
            pause_tier=None if r.tier is None else r.tier.value,
            memory=memory,
            auto_pause=auto or None,
        )

    async def _pause(
        self,
        sandbox_id: str,
        memory: bool = True,
        timings: Timings | None = None,
        *,
        require_healthy_guest: bool = False,
    ) -> None:
        t = timings or Timings()
        self.table.get(sandbox_id)
        async with self.table.lock(sandbox_id):
            r = self.table.get(sandbox_id)
            if r.in_standby_on_disk:
                # Already on disk, by the node: now paused by its user too.
                assert r.paused is not None
                r.paused = replace(r.paused, standby=False)
                await self.table.save(r)
                return
            if r.state is SandboxState.PAUSED:
                raise Conflict(f"sandbox {sandbox_id!r} is already paused")
            if r.state is not SandboxState.RUNNING or r.instance is None:
                raise Conflict(f"sandbox {sandbox_id!r} cannot be paused while {r.state}")
            if require_healthy_guest:
                with t.stage("guest-check"):
                    ok = await self.booter.envd.at(r.instance.address).healthy(GUEST_CHECK_TIMEOUT)
                if not ok:
                    raise Unavailable(
                        f"sandbox {sandbox_id!r} was not paused: its guest agent (envd) does "
                        "not answer; the sandbox keeps running"
                    )
            if not memory:
                # A crash once the container is gone finds the files: paused, files only.
                r.pending = PendingOp("pause")
                await self.table.save(r)
                try:
                    with t.stage("stop"):
                        await self.runtime.sync_files(r.instance)
                        await self.runtime.destroy(r.instance)
                finally:
                    r.pending = None
                self.ctx.stopped(sandbox_id)
                r.instance = None
                r.paused = PausedState(PauseTier.FILES, self.ctx.now())
            else:
                with t.stage("freeze"):
                    await self.runtime.freeze(r.instance)
                crashpoint.hit("pause.frozen")
                r.paused = PausedState(PauseTier.FROZEN, self.ctx.now())
            r.state = SandboxState.PAUSED
            await self.table.save(r)
            if memory and self.ctx.settings.hibernate_after <= 0:
                await self._hibernate_locked(r, t)

    async def hibernate(self, sandbox_id: str, timings: Timings | None = None) -> None:
        """A user's (or a test's) hibernation of a frozen sandbox, counted; anything else
        is left as it is."""
        with self.stats.observe("hibernate", sandbox_id):
            await self._hibernate(sandbox_id, timings)

    async def _hibernate(self, sandbox_id: str, timings: Timings | None = None) -> None:
        async with self.table.lock(sandbox_id):
            r = self.table.find(sandbox_id)
            if r is not None and r.tier is PauseTier.FROZEN:
                await self._hibernate_locked(r, timings or Timings())

    async def hibernate_idle(self) -> None:
        """The timers' round: frozen sandboxes idle for `hibernate_after` seconds go on
        disk."""
        after = timedelta(seconds=self.ctx.settings.hibernate_after)
        now = self.ctx.now()
        idle = [
            r.sandbox_id
            for r in self.table.all()
            if r.tier is PauseTier.FROZEN
            and r.paused is not None
            and now - r.paused.paused_at >= after
        ]
        for sandbox_id in idle:
            with sandbox_context(sandbox_id):
                try:
                    await self._hibernate(sandbox_id)
                except Exception:
                    log.exception("hibernating %s failed", sandbox_id)

    async def hibernate_all(self) -> None:
        """At shutdown: frozen sandboxes would die with the host's processes on a reboot."""
        for r in self.table.all():
            if r.tier is PauseTier.FROZEN:
                try:
                    await self._hibernate(r.sandbox_id)
                except Exception:
                    log.exception("hibernating %s at shutdown failed", r.sandbox_id)

    async def _hibernate_locked(self, r: SandboxRecord, t: Timings) -> None:
        assert r.instance is not None and r.paused is not None
        inst = r.instance
        # A new name each time: the previous image may still be being dropped after a resume.
        name = f"hib-{r.sandbox_id}-{secrets.token_hex(4)}"
        # From here a crash leaves a checkpointed or released container: recovery finds the
        # image and the files by this record.
        r.pending = PendingOp(
            "hibernate", image=name, layer=self.booter.storage.seal_digest(r.sandbox_id)
        )
        await self.table.save(r)
        try:
            image = await self.templates.fresh_image(name)
            with t.stage("checkpoint"):
                await self.runtime.checkpoint(inst, image, leave_running=False)
            crashpoint.hit("hibernate.checkpointed")
            with t.stage("release"):
                await self.runtime.sync_files(inst)
                await self.runtime.destroy(inst)
            self.ctx.stopped(r.sandbox_id)
            crashpoint.hit("hibernate.released")
            r.instance = None
            # Sealed, the files are plain layers: the repository can hold the whole sandbox.
            await self.booter.seal(r, t)
            crashpoint.hit("hibernate.sealed")
        except BaseException:
            r.pending = None
            raise
        r.paused = replace(r.paused, tier=PauseTier.HIBERNATED, image=name)
        r.pending = None
        await self.table.save(r)
        # Not one in standby: hundreds may go to disk and back; a drain still publishes it.
        if self.templates.has_repository and not r.paused.standby:
            self.ctx.spawn(self._publish_hibernation(r.sandbox_id, name))
        log.info("sandbox %s hibernated", r.sandbox_id)

    async def to_disk(self, sandbox_id: str, inst: Instance) -> bool:
        """Hibernates a sandbox in standby (its container `inst` frozen) for the idle
        tracker: paused here, still running to its user, restored by its next request
        (`connect`). Whether it went to disk."""
        async with self.table.lock(sandbox_id):
            r = self.table.find(sandbox_id)
            mine = r is not None and r.instance is not None and r.instance.id == inst.id
            if r is None or r.state is not SandboxState.RUNNING or not mine:
                log.info("sandbox %s left in standby in memory: it changed meanwhile", sandbox_id)
                return False
            r.paused = PausedState(PauseTier.FROZEN, self.ctx.now(), standby=True)
            r.state = SandboxState.PAUSED
            try:
                await self._hibernate_locked(r, Timings())
            except BaseException:
                if r.instance is not None:  # not checkpointed: still frozen, in standby
                    r.state, r.paused = SandboxState.RUNNING, None
                    await self.table.save(r)
                raise
        log.info("sandbox %s in standby on disk (restored at its next request)", sandbox_id)
        return True

    async def _publish_hibernation(
        self, sandbox_id: str, image: str, delay: float = PUBLISH_HIBERNATION_AFTER
    ) -> bool:
        """Publishes a hibernated sandbox; whether it is in the repository afterwards."""
        # Not at once: a sandbox resumed within seconds (the common case for an agent) is
        # never published, and the publish does not take CPU from that resume.
        await asyncio.sleep(delay)
        task = self._publishing.get(image)
        if task is None:  # one publish per image, however many ask (timer, drain)
            task = asyncio.ensure_future(self._publish_once(sandbox_id, image))
            self._publishing[image] = task
            task.add_done_callback(lambda _t: self._publishing.pop(image, None))
        return await asyncio.shield(task)

    async def _publish_once(self, sandbox_id: str, image: str) -> bool:
        async with self.table.lock(sandbox_id):
            r = self.table.find(sandbox_id)
            if r is None or r.paused is None or r.paused.image != image:
                return False
            if r.paused.published:
                return True
            task = self.templates.publish(self._hibernation_record(r, image))
        if task is None:
            return False
        (ok,) = await asyncio.gather(task, return_exceptions=True)
        if ok is not True:
            return False  # failed (logged) or cancelled by a resume/kill: the local copy stays
        async with self.table.lock(sandbox_id):
            still = self.table.find(sandbox_id)
            if still is None or still.paused is None or still.paused.image != image:
                return False
            await self.templates.hand_over(image)
            still.paused.published = True
            await self.table.save(still)
        return True

    async def publish_now(self, sandbox_id: str) -> bool:
        """Hibernates (a running sandbox is paused first) and publishes a sandbox at once,
        so another node can resume it (drain). Whether it is in the repository now."""
        r = self.table.get(sandbox_id)
        if r.state is SandboxState.RUNNING:
            await self._pause(sandbox_id)
            r = self.table.get(sandbox_id)
            # Moving is the operator's doing, not its user's: it stays running to its user
            # (in standby), and its next request anywhere restores it.
            if r.paused is not None:
                r.paused = replace(r.paused, standby=True)
                await self.table.save(r)
        if r.state is SandboxState.PAUSED and r.tier is PauseTier.FROZEN:
            await self._hibernate(sandbox_id)
            r = self.table.get(sandbox_id)
        if r.tier is not PauseTier.HIBERNATED or r.paused is None or r.paused.image is None:
            return False
        return await self._publish_hibernation(sandbox_id, r.paused.image, delay=0)

    def _hibernation_record(self, r: SandboxRecord, image: str) -> TemplateRecord:
        # The sandbox's own record rides along, so another node can take the sandbox over.
        portable = replace(r, instance=None, pending=None, upper=None)
        return TemplateRecord(
            template_id=image,
            kind=TemplateKind.HIBERNATION,
            layers=list(r.layers),
            checkpoint=image,
            sandbox_id=r.sandbox_id,
            parent=r.template_id,
            env=dict(r.boot.env),
            user=r.boot.user,
            workdir=r.boot.workdir,
            cpu_count=r.cpu_count,
            memory_mb=r.memory_mb,
            created_at=self.ctx.now().isoformat(),
            volume_mounts=list(r.volume_mounts),
            hibernated=portable,
        )

    # ------------------------------------------------------------------ resume
    async def _resume_locked(self, r: SandboxRecord, t: Timings) -> None:
        assert r.paused is not None
        paused = r.paused
        if paused.tier is not PauseTier.FROZEN:
            # A request to a sandbox in standby on disk waits a while for room rather than
            # fail: it is running to its user, the node chose to put it there.
            patience = STANDBY_ROOM_PATIENCE if paused.standby else 0.0
            await self.table.admit(r.memory_mb, patience=patience)
        r.state = SandboxState.RESUMING
        dropped: str | None = None
        try:
            if paused.tier is PauseTier.FROZEN:
                assert r.instance is not None
                with t.stage("thaw"):
                    await self.runtime.thaw(r.instance)
            elif paused.tier is PauseTier.HIBERNATED:
                assert paused.image is not None
                what = f"paused sandbox {r.sandbox_id!r}"
                async with contextlib.AsyncExitStack() as stack:
                    with t.stage("fetch"):  # the fetch only, not the use
                        image = await stack.enter_async_context(
                            self.templates.hibernation_image(paused.image, what)
                        )
                    await self.booter.boot(r, t, image=image, init=False)
                crashpoint.hit("resume.restored")
                dropped = paused.image
            else:  # files only: boot fresh on the kept upper
                await self.booter.boot(r, t)
        except BaseException:
            r.state = SandboxState.PAUSED
            raise
        r.state = SandboxState.RUNNING
        r.paused = None
        if dropped is not None:
            # Saved first: a crash before the save finds it hibernated, with its image.
            await self.table.save(r)
            self.ctx.spawn(self.templates.drop_image(dropped))

    async def connect(
        self,
        sandbox_id: str,
        timeout: int | None,
        memory: bool | None = None,
        timings: Timings | None = None,
    ) -> tuple[SandboxRecord, bool]:
        """A user's resume of a paused sandbox (E2B's connect), counted and logged; extends
        a running one's timeout. Returns the record and whether it was resumed."""
        await self.ctx.wake(sandbox_id)
        with self.stats.observe("connect", sandbox_id):
            r, resumed = await self._connect(sandbox_id, timeout, memory, timings)
        if resumed:
            self.logs.note(sandbox_id, "sandbox resumed")
            self.events.record(ev.RESUMED, r)
        return r, resumed

    async def restore_standby(self, sandbox_id: str) -> None:
        """Restores a sandbox in standby on disk for a request that reaches it (the idle
        tracker's wake): the node's doing, not counted as a resume."""
        await self._connect(sandbox_id, None)

    async def _connect(
        self,
        sandbox_id: str,
        timeout: int | None,
        memory: bool | None = None,
        timings: Timings | None = None,
    ) -> tuple[SandboxRecord, bool]:
        t = timings or Timings()
        settings = self.ctx.settings
        self.table.get(sandbox_id)
        async with self.table.lock(sandbox_id):
            r = self.table.get(sandbox_id)
            resumed = False
            check_timeout(timeout, settings)
            if r.in_standby_on_disk:
                # Running to its user: restored, its timeout only ever extended.
                await self._resume_locked(r, t)
                if timeout is not None:
                    r.end_at = max(r.end_at, self.ctx.now() + timedelta(seconds=timeout))
                log.info("sandbox %s back from standby on disk", sandbox_id)
            elif r.state is SandboxState.PAUSED:
                assert r.paused is not None
                if memory is False and r.paused.tier is not PauseTier.FILES:
                    # E2B's on_resume="reboot": drop the memory, keep the files.
                    if r.instance:
                        await self.runtime.sync_files(r.instance)
                        await self.runtime.destroy(r.instance)
                        r.instance = None
                    r.paused = PausedState(PauseTier.FILES, self.ctx.now())
                await self._resume_locked(r, t)
                resumed = True
                ttl = settings.default_timeout if timeout is None else timeout
                r.end_at = self.ctx.now() + timedelta(seconds=ttl)
            elif timeout is not None:
                r.end_at = max(r.end_at, self.ctx.now() + timedelta(seconds=timeout))
            await self.table.save(r)
        return r, resumed

    async def resolve(
        self, sandbox_id: str, port: int, traffic_token: str | None = None
    ) -> Upstream:
        """Where the proxy sends a request for a sandbox's port, resuming the sandbox if it
        may be. A private sandbox's own ports want its traffic token (checked first: a
        refused request wakes nothing)."""
        r = self.table.find(sandbox_id)
        if r is None or r.state not in LIVE_STATES:
            raise SandboxNotFound(sandbox_id)
        lock = self.table.lock(sandbox_id)
        if lock.locked():
            # An operation (snapshot, fork, pause) has the sandbox: a connection opened
            # while it is checkpointed would wedge the restored copy's network (runsc
            # 20240729), so the request waits for it, then goes where the sandbox is now.
            async with lock:
                pass
            r = self.table.find(sandbox_id)
            if r is None or r.state not in LIVE_STATES:
                raise SandboxNotFound(sandbox_id)
        presented = (traffic_token or "").encode()
        if (
            r.traffic_access_token
            and port != ENVD_PORT
            and not hmac.compare_digest(presented, r.traffic_access_token.encode())
        ):
            raise Forbidden(
                f"sandbox {sandbox_id!r} is private: send its traffic access token in "
                "the e2b-traffic-access-token header"
            )
        if r.in_standby_on_disk:
            await self._connect(sandbox_id, None)
        elif r.state is not SandboxState.RUNNING:
            # E2B: a filesystem-only pause is resumed only when asked (a cold boot loses
            # the processes), never by traffic.
            if not r.auto_resume or r.tier is PauseTier.FILES:
                raise SandboxNotFound(sandbox_id, state="paused")
            resumed, _ = await self._connect(sandbox_id, auto_resume_timeout(r, self.ctx.settings))
            self.events.record(ev.RESUMED, resumed, auto_resume=True)
        if r.address is None:
            raise SandboxNotFound(sandbox_id)
        mask = r.mask_request_host
        upstream = Upstream(r.address, port, mask.replace("${PORT}", str(port)) if mask else None)
        await self.ctx.wake(sandbox_id)
        return upstream
