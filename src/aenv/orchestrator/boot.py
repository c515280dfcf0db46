"""Starting sandboxes: the runtime spec of a record, boot slots, booting or restoring a
container and readying envd in it, and re-stacking (sealing the upper into a layer).

Every path that starts a container — create, the warm pool, resume, snapshot, fork — comes
through `Booter.boot`, so the boot slots bound all of them together."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import secrets
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from .. import ENVD_VERSION
from ..domain import (
    ENVD_PORT,
    CreateRequest,
    Instance,
    SandboxRecord,
    SandboxState,
    TemplateRecord,
    Timings,
    new_id,
)
from ..errors import AenvError, Conflict, RuntimeFailure, Unavailable
from ..logctx import sandbox_context
from ..runtime.base import Mount, Runtime, SandboxSpec
from ..runtime.bundle import EnvdBundle
from ..volumes import VolumeStore
from .context import NodeContext
from .egress_trust import TRUST_ENV, install_ca
from .envd_pool import EnvdPool
from .lineage import lineage_from
from .squashing import Squasher, replace_run, run_to_squash
from .storage import SandboxStorage
from .table import SandboxTable

log = logging.getLogger("aenv.orchestrator")

# Seconds a create may expect to wait for a boot slot (the queue ahead of it, at the boots'
# recent pace) before it is refused with 503 and Retry-After instead: well inside the SDKs'
# request timeouts, so that a create is never abandoned by its client while still queued.
MAX_QUEUE_WAIT = 30.0


class Booter:
    def __init__(
        self,
        ctx: NodeContext,
        table: SandboxTable,
        runtime: Runtime,
        storage: SandboxStorage,
        envd: EnvdPool,
        bundle: EnvdBundle,
        volumes: VolumeStore | None = None,
    ) -> None:
        self.ctx = ctx
        self.volumes = volumes
        self.table = table
        self.runtime = runtime
        self.storage = storage
        self.envd = envd
        self.bundle = bundle
        self.squasher = Squasher(storage.layers)
        n = ctx.settings.boot_concurrency or 2 * (os.cpu_count() or 1)
        self._slots = asyncio.Semaphore(n)
        self._slot_count = n
        self._queue_limit = ctx.settings.boot_queue  # 0: by the expected wait
        self._waiting = 0  # boots waiting for a slot now
        self._boot_seconds = 1.0  # a running average of how long a slot is held

    @property
    def waiting(self) -> int:
        """Boots waiting for a slot now."""
        return self._waiting

    def check_queue(self, count: int = 1) -> None:
        """Refuses (503, `Retry-After`) new sandboxes that would wait behind more boots than
        the node takes in queue: the caller learns at once, and when to come back, instead
        of a request that hangs and then half-fails (envd not ready in time)."""
        if not self._slots.locked():
            return
        rounds = (self._waiting + count) / self._slot_count
        if self._queue_limit:
            if self._waiting + count <= self._queue_limit:
                return
        elif rounds * self._boot_seconds <= MAX_QUEUE_WAIT:
            return
        raise Unavailable(
            f"the node is busy starting sandboxes ({self._waiting} waiting for "
            f"{self._slot_count} boot slots); try again shortly",
            retry_after=max(1.0, rounds * self._boot_seconds),
        )

    # ------------------------------------------------------------------ records
    def new_record(
        self,
        template: TemplateRecord,
        req: CreateRequest,
        *,
        alias: str | None,
        timeout: int,
        cpu: int,
        mem: int,
        layers: builtins.list[str] | None = None,
    ) -> SandboxRecord:
        """A record in `creating` with a fresh upper; `layers` (a boot snapshot's) replace
        the template's own."""
        now = self.ctx.now()
        sandbox_id = new_id()
        return SandboxRecord(
            sandbox_id=sandbox_id,
            template_id=template.template_id,
            alias=alias,
            client_id="aenv",
            started_at=now,
            end_at=now + timedelta(seconds=timeout),
            cpu_count=cpu,
            memory_mb=mem,
            disk_mb=self.ctx.settings.default_disk_mb,
            state=SandboxState.CREATING,
            envd_version=ENVD_VERSION,
            envd_access_token=envd_token(),
            metadata=dict(req.metadata),
            env_vars=dict(req.env_vars),
            auto_pause=req.auto_pause,
            auto_pause_memory=req.auto_pause_memory,
            auto_resume=req.auto_resume,
            egress=replace(req.egress),
            traffic_access_token=traffic_token(req),
            mask_request_host=req.mask_request_host,
            owner=req.owner,
            standby_after=req.standby_after,
            timeout=timeout,
            layers=list(template.layers if layers is None else layers),
            upper=str(self.storage.first_upper(sandbox_id)),
            boot=template.boot_info(),
            lineage=lineage_from(template),
        )

    def spec(self, r: SandboxRecord) -> SandboxSpec:
        layers = [self.storage.layers.path(d) for d in r.layers]
        for d, p in zip(r.layers, layers, strict=True):
            if not p.is_dir():
                raise Unavailable(f"layer {d} of sandbox {r.sandbox_id} is missing on this node")
        return SandboxSpec(
            sandbox_id=r.sandbox_id,
            layers=layers,
            args=self.bundle.init_args(port=ENVD_PORT),
            env=self.bundle.init_env(access_token=r.envd_access_token),
            mounts=[self.bundle.mount(), *self._volume_mounts(r)],
            cpu_count=r.cpu_count,
            memory_mb=r.memory_mb,
            hostname="sandbox",
            upper=Path(r.upper) if r.upper else None,
            disk_mb=r.disk_mb,
            egress=None if r.egress.is_open else r.egress,
        )

    def _volume_mounts(self, r: SandboxRecord) -> builtins.list[Mount]:
        """Bind mounts of the sandbox's volumes, the same at every boot and restore (a
        checkpoint restores only with the mounts it was taken with)."""
        if not r.volume_mounts:
            return []
        if self.volumes is None:
            raise Unavailable("this node has no volume store")
        out = []
        for m in r.volume_mounts:
            try:
                source = self.volumes.data_dir(m.volume_id)
            except AenvError:
                raise Conflict(
                    f"volume {m.name!r}, which sandbox {r.sandbox_id} mounts at {m.path}, "
                    "was deleted"
                ) from None
            out.append(Mount(source=source, destination=m.path, readonly=m.read_only))
        return out

    # ------------------------------------------------------------------ booting
    async def queue_behind(self) -> None:
        """Waits until every boot queued so far has had its slot (speculative work)."""
        async with self._slots:
            pass

    async def boot(
        self,
        r: SandboxRecord,
        t: Timings,
        *,
        image: Path | None = None,
        reuse: Instance | None = None,
        init_from: str | None = None,
        init: bool = True,
    ) -> Instance:
        """Starts the sandbox's container (fresh, or restored from `image`) and readies envd.

        `init_from` is the access token the restored envd still holds (it must authorise
        its own re-initialisation; a fresh one holds the record's, from the spec);
        `init=False` skips /init for a plain resume."""
        if r.upper is not None:
            await asyncio.to_thread(
                self.storage.ensure_upper, r.sandbox_id, Path(r.upper), r.disk_mb
            )
            self.ctx.spawn(asyncio.to_thread(self.storage.refill_disks), name="aenv-disks")
        run = run_to_squash(r.layers, 0)
        if run is not None:  # past what one overlay mount takes: cannot wait for later
            with t.stage("squash"):
                await self.apply_squash(r, run, await self.squasher.squash(run, r.sandbox_id))
        spec = self.spec(r)
        inst: Instance | None = None
        with t.stage("queue") if self._slots.locked() else contextlib.nullcontext():
            self._waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self._waiting -= 1
        held_from = time.monotonic()
        try:
            if image is None:
                with t.stage("boot"):
                    inst = await self.runtime.create(spec, reuse=reuse)
            else:
                with t.stage("restore"):
                    inst = await self.runtime.restore(spec, image, reuse=reuse)
            r.instance = inst
            with t.stage("envd-ready"):
                await self.envd.at(inst.address).wait_ready(self.runtime.ready_within())
            if init:
                current = init_from if image is not None else (r.envd_access_token or None)
                with t.stage("envd-init"):
                    await self.init_envd(r, current_token=current)
        except BaseException as e:
            if inst is not None:
                await self.destroy_quietly(inst)
            r.instance = None
            if isinstance(e, AenvError | asyncio.CancelledError):
                raise
            raise RuntimeFailure(
                f"sandbox {r.sandbox_id} failed to start: {type(e).__name__}: {e}"
            ) from e
        finally:
            self._slots.release()
            held = time.monotonic() - held_from
            self._boot_seconds = 0.8 * self._boot_seconds + 0.2 * held
        if r.retired_layers:  # the new container runs on the squashed stack
            gone = [d for d in r.retired_layers if d not in r.layers]
            await asyncio.to_thread(self.storage.unhold, "sandbox", r.sandbox_id, gone)
            r.retired_layers = []
        return inst

    async def init_envd(self, r: SandboxRecord, *, current_token: str | None = None) -> None:
        """Gives envd the sandbox's token, environment, user and working directory; with
        header transforms in its egress rules, the node's egress CA goes into its trust
        stores (`egress_trust`)."""
        assert r.instance is not None
        ca = self.runtime.egress_ca_pem if r.egress.intercepts else None
        env = {**r.boot.env, **r.env_vars}
        if ca is not None:
            env = {**TRUST_ENV, **env}
        await self.envd.at(r.instance.address, current_token).init(
            token=r.envd_access_token,
            env_vars=env,
            user=r.boot.user,
            workdir=r.boot.workdir,
            sandbox_id=r.sandbox_id,  # a restored copy of another sandbox gets its own identity
        )
        if ca is not None:
            await install_ca(self.envd.at(r.instance.address, r.envd_access_token), ca)

    async def trust_egress_ca(self, r: SandboxRecord) -> None:
        """The egress CA into a running sandbox's trust stores (its envd initialised)."""
        ca = self.runtime.egress_ca_pem
        if ca is not None and r.instance is not None:
            await install_ca(self.envd.at(r.instance.address, r.envd_access_token), ca)

    async def apply_egress(self, r: SandboxRecord) -> None:
        """Puts the record's egress rules in force on its running container."""
        assert r.instance is not None
        await self.runtime.set_egress(r.instance, r.egress)

    async def preboot(
        self,
        template: TemplateRecord,
        cpu: int,
        mem: int,
        *,
        alias: str | None,
        boot: TemplateRecord | None,
        timings: Timings | None = None,
    ) -> SandboxRecord:
        """A sandbox of the template for no one yet (memory reserved by the caller): booted,
        or restored from the boot snapshot `boot`; envd not initialised; warmed up. What it
        left behind is gone if it fails."""
        t = timings or Timings()
        r = self.new_record(
            template,
            CreateRequest(),
            alias=alias,
            timeout=self.ctx.settings.default_timeout,
            cpu=cpu,
            mem=mem,
            layers=None if boot is None else boot.layers,
        )
        if boot is not None and boot.envd_token:
            r.envd_access_token = boot.envd_token  # what the restored envd holds
        self.table.add(r)
        with sandbox_context(r.sandbox_id):
            try:
                await asyncio.to_thread(self.storage.hold, "sandbox", r.sandbox_id, r.layers)
                image = None
                if boot is not None and boot.checkpoint is not None:
                    image = self.storage.image_dir(boot.checkpoint)
                await self.boot(r, t, image=image, init=False)
                # Also after a restore: the files bash and envd map are re-opened lazily.
                await self._warm_up(r)
            except BaseException:
                self.table.discard(r.sandbox_id)
                await self.forget(r)
                raise
        return r

    async def _warm_up(self, r: SandboxRecord) -> None:
        """Runs one login shell in a pre-booted sandbox: the first command a user runs is
        otherwise ~45 ms slower (envd's process code and bash's files are read through
        gVisor's gofer for the first time). Best effort: an image without bash just skips."""
        assert r.instance is not None
        rpc = self.envd.at(r.instance.address, r.envd_access_token)
        try:
            await rpc.run("/bin/bash", ["-l", "-c", "true"], user=r.boot.user, timeout=10)
        except Exception as e:
            log.debug("warm-up of %s: %s", r.sandbox_id, e)

    async def destroy_quietly(self, inst: Instance) -> None:
        try:
            await self.runtime.destroy(inst)
        except Exception:
            log.exception("destroying %s failed", inst.id)

    async def forget(self, r: SandboxRecord) -> None:
        """Drops what a sandbox that is gone left on this node's disk: its uppers and
        its layer references (a hibernation image is its pause tier's to drop)."""
        self.ctx.stopped(r.sandbox_id)
        await asyncio.to_thread(self.storage.remove_sandbox, r.sandbox_id)
        await asyncio.to_thread(self.storage.release, "sandbox", r.sandbox_id)

    # ------------------------------------------------------------------ re-stacking
    async def seal(self, r: SandboxRecord, t: Timings) -> None:
        """Seals the upper as a layer on top of the stack; the sandbox goes on on a fresh
        one. An untouched upper stays: a layer of nothing would only lengthen the stack.
        The layer takes the digest of the record's pending operation, if it names one."""
        assert r.upper is not None
        planned = r.pending.layer if r.pending is not None else None
        with t.stage("seal"):
            if await asyncio.to_thread(_is_empty, Path(r.upper)):
                return
            digest = await asyncio.to_thread(
                self.storage.seal, Path(r.upper), r.sandbox_id, planned
            )
            r.layers = [digest, *r.layers]
            await asyncio.to_thread(self.storage.hold, "sandbox", r.sandbox_id, [digest])
            r.upper = str(await asyncio.to_thread(self.storage.new_upper, r.sandbox_id))
        self.squash_later(r)

    async def restore_in_place(
        self, r: SandboxRecord, t: Timings, image: Path, stopped: Instance | None, what: str
    ) -> None:
        """Restores a sandbox from `image` under its own id: in its own network slot when
        `stopped` is its stopped container (same address for everyone), else in a fresh one.
        A sandbox that does not come back is marked lost (`what`: after which operation)."""
        try:
            await self.boot(r, t, image=image, reuse=stopped, init=False)
        except BaseException as e:
            if stopped is not None:
                await self.destroy_quietly(stopped)
            r.state = SandboxState.LOST
            r.note = f"restoring it {what} failed: {e}"
            await self.table.save(r)
            raise

    # ------------------------------------------------------------------ squashing
    def squash_later(self, r: SandboxRecord) -> None:
        run = run_to_squash(r.layers, self.ctx.settings.squash_layers)
        if run is not None:
            self.ctx.spawn(self._squash_in_background(r.sandbox_id, run))

    async def _squash_in_background(self, sandbox_id: str, run: builtins.list[str]) -> None:
        try:
            merged = await self.squasher.squash(run, sandbox_id)
        except Exception:
            log.exception("squashing the layers of %s failed", sandbox_id)
            return
        async with self.table.lock(sandbox_id):
            r = self.table.find(sandbox_id)
            gone = (SandboxState.KILLING, SandboxState.KILLED, SandboxState.LOST)
            if r is not None and r.state not in gone:
                await self.apply_squash(r, run, merged)

    async def apply_squash(self, r: SandboxRecord, run: builtins.list[str], merged: str) -> None:
        new = replace_run(r.layers, run, merged)
        if new is None:
            return
        await asyncio.to_thread(self.storage.hold, "sandbox", r.sandbox_id, [merged])
        r.retired_layers = sorted(set(r.retired_layers) | (set(run) - set(new)))
        r.layers = new
        await self.table.save(r)
        log.info("sandbox %s: %d layers squashed into %s", r.sandbox_id, len(run), merged)


def envd_token() -> str:
    """A new sandbox's envd access token. Every sandbox has one (whatever the request's
    `secure`): without it whoever knows the id runs commands, or re-keys it via /init."""
    return secrets.token_urlsafe(24)


def traffic_token(req: CreateRequest) -> str:
    """A new sandbox's traffic access token: its own, whatever it was made from."""
    return "" if req.public_traffic else secrets.token_urlsafe(24)


def _is_empty(d: Path) -> bool:
    with os.scandir(d) as it:
        return next(it, None) is None
