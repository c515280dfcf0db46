"""The orchestrator: the sandbox lifecycle state machine over a runtime and the catalog.

It owns the in-memory table of sandboxes (persisted to the catalog on every change), one lock
per sandbox so lifecycle operations on one sandbox never interleave, and the TTL/hibernation
loop. Pausing, snapshots and fork live in `lifecycle.py`; this module holds the core.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import re
import secrets
import string
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from .. import ENVD_VERSION
from ..config import Settings
from ..errors import (
    AenvError,
    BadRequest,
    NotFound,
    RuntimeFailure,
    Unavailable,
)
from ..runtime.base import Instance, Mount, Runtime, SandboxSpec
from .catalog import Catalog
from .durable import Durable
from .envd_client import EnvdClient
from .models import CreateRequest, SandboxRecord, State, utcnow
from .squashing import Squasher, replace_run, run_to_squash
from .storage import SandboxStorage

log = logging.getLogger("aenv.orchestrator")

# Template id and CPU count. Not the memory size: a restored sentry takes the new limit
# (a 512 MiB boot snapshot restores as a 256 MiB or 1 GiB sandbox, `free` says so).
BootKey = tuple[str, int]
# Shapes of sandbox a node keeps boot snapshots of (each ~20 MiB of memory image).
MAX_BOOT_SNAPSHOTS = 8
# Seconds between handing out a pool sandbox and booting its replacement.
REFILL_DELAY = 0.75

ENVD_PORT = 49983
_ID_ALPHABET = string.ascii_lowercase + string.digits
# Characters a Server-Timing metric name (an HTTP token) cannot hold.
_TOKEN_UNSAFE = re.compile(r"[^A-Za-z0-9!#$%&'*+.^_`|~-]")
# States in which a sandbox counts against the node's memory budget.
_HOLDS_MEMORY = {State.CREATING, State.RUNNING, State.PAUSING, State.RESUMING}


def new_id(prefix: str = "i") -> str:
    # E2B-style: 20 lowercase alphanumerics; no '-' so `{port}-{id}.{domain}` parses.
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(20 - len(prefix)))


class Timings:
    """Stage durations of one lifecycle operation, for the `Server-Timing` header."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stages[name] = self.stages.get(name, 0.0) + (time.perf_counter() - t0) * 1000

    def header(self) -> str:
        """`name;dur=12.3, other;dur=4.0` (names made HTTP tokens); empty if no stage ran."""
        return ", ".join(
            f"{_TOKEN_UNSAFE.sub('_', name) or 'step'};dur={float(ms):.1f}"
            for name, ms in self.stages.items()
        )


def check_timeout(timeout: int | None, settings: Settings) -> None:
    """The range check of a sandbox timeout in seconds (None: the default applies). Its upper
    bound is a setting, so the API's pydantic models cannot hold it: the API calls this before
    doing any work, the orchestrator again for its other callers."""
    if timeout is not None and not 0 <= timeout <= settings.max_timeout:
        raise BadRequest(f"timeout must be between 0 and {settings.max_timeout} seconds")


def _host_memory_mb() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20)


class OrchestratorCore:
    def __init__(
        self,
        settings: Settings,
        catalog: Catalog,
        runtime: Runtime,
        *,
        storage: SandboxStorage,
        bundle: Any,
        durable: Durable | None = None,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.runtime = runtime
        self.storage = storage
        # The envd runtime bundle (runtime.bundle.EnvdBundle), mounted into every sandbox.
        self._bundle = bundle
        self.durable = durable
        self.envd = EnvdClient()
        self.squasher = Squasher(storage.layers)
        self._boot_slots = asyncio.Semaphore(settings.boot_concurrency or 2 * (os.cpu_count() or 1))
        self._records: dict[str, SandboxRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self.memory_budget_mb = settings.max_memory_mb or int(_host_memory_mb() * 0.9)
        # Pre-booted sandboxes of the default template (see `_take_warm`).
        self._warm: builtins.list[SandboxRecord] = []
        # Boot snapshots (see lifecycle._make_boot_snapshot), per shape of sandbox:
        # (template id, cpu) -> (snapshot id, its document); shapes tried.
        self._boot_snapshots: dict[BootKey, tuple[str, dict[str, Any]]] = {}
        self._boot_tried: set[BootKey] = set()
        self._boot_cleaned = False  # boot snapshots of earlier runs deleted
        self._boot_run = secrets.token_hex(8)  # tells this run's boot snapshots apart
        self._warm_task: asyncio.Task[None] | None = None
        self._closing = False

    # ------------------------------------------------------------------ lifecycle of the node
    async def start(self) -> None:
        records = await asyncio.to_thread(self.catalog.sandboxes)
        keep = {
            r.instance["container_id"]
            for r in records
            if r.instance and r.state in (State.RUNNING, State.PAUSED)
        }
        recovered = await self.runtime.start(keep)
        for r in records:
            if r.state is State.KILLED:
                await self.catalog.adelete_sandbox(r.sandbox_id)
                continue
            if r.instance and r.instance["container_id"] in recovered:
                r.instance = recovered[r.instance["container_id"]].to_json()
                if r.state not in (State.RUNNING, State.PAUSED):
                    r.state = State.RUNNING
                log.info("recovered sandbox %s (%s)", r.sandbox_id, r.state)
            elif (
                r.state is State.PAUSED
                and r.paused_state
                and r.paused_state.get("tier")
                in (
                    "hibernated",
                    "files",
                )
            ):
                r.instance = None  # durable on disk; nothing was running
            elif r.state is not State.LOST:
                r.state = State.LOST
                r.instance = None
                r.note = "it was running when the server stopped and could not be recovered"
                log.warning("sandbox %s lost across the restart", r.sandbox_id)
            self._records[r.sandbox_id] = r
            await self.catalog.aput_sandbox(r)
        if self.durable is not None:
            await self.durable.start()
        for tid, doc, _names in await asyncio.to_thread(self.catalog.templates):
            await asyncio.to_thread(
                self.storage.hold, "template", tid, list(doc.get("layers") or [])
            )
        self._loop_task = asyncio.create_task(self._timer_loop(), name="aenv-timers")
        self._refill_warm()

    async def close(self) -> None:
        self._closing = True
        if self._warm_task:
            self._warm_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._warm_task
        for w in self._warm:
            self._records.pop(w.sandbox_id, None)
            if w.instance:
                await self._destroy_quietly(Instance.from_json(w.instance))
            await self._forget(w)
        self._warm.clear()
        if self._loop_task:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        await self._on_shutdown()
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        if self.durable is not None:
            await self.durable.close()
        await self.runtime.close()
        await self.envd.close()

    async def _on_shutdown(self) -> None:
        """Hook for subclasses (hibernate frozen sandboxes)."""

    async def _timer_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self._tick()
            except Exception:
                log.exception("timer loop")

    async def _tick(self) -> None:
        now = utcnow()
        for r in list(self._records.values()):
            if r.end_at > now or r.state is not State.RUNNING:
                continue
            try:
                await self._on_timeout(r)
            except AenvError as e:
                log.info("timeout handling of %s: %s", r.sandbox_id, e.message)
            except Exception:
                log.exception("timeout handling of %s failed", r.sandbox_id)

    async def _on_timeout(self, r: SandboxRecord) -> None:
        log.info("sandbox %s timed out: killing", r.sandbox_id)
        await self.kill(r.sandbox_id)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        lock = self._locks.get(sandbox_id)
        if lock is None:
            lock = self._locks[sandbox_id] = asyncio.Lock()
        return lock

    async def _save(self, r: SandboxRecord) -> None:
        await self.catalog.aput_sandbox(r)

    # ------------------------------------------------------------------ queries
    def get(self, sandbox_id: str) -> SandboxRecord:
        r = self._records.get(sandbox_id)
        if r is None or r.state in (State.KILLED, State.KILLING, State.CREATING):
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        if r.state is State.LOST:
            raise NotFound(f"sandbox {sandbox_id!r} was lost: {r.note}")
        return r

    def list(
        self,
        *,
        metadata: dict[str, str] | None = None,
        states: set[str] | None = None,
        template: str | None = None,
    ) -> builtins.list[SandboxRecord]:
        out = []
        for r in self._records.values():
            if r.state not in (State.RUNNING, State.PAUSED, State.PAUSING, State.RESUMING):
                continue
            api_state = "paused" if r.state is State.PAUSED else "running"
            if states and api_state not in states:
                continue
            if template and template not in (r.template_id, r.alias):
                continue
            if metadata and any(r.metadata.get(k) != v for k, v in metadata.items()):
                continue
            out.append(r)
        out.sort(key=lambda r: (r.started_at, r.sandbox_id))
        return out

    # ------------------------------------------------------------------ booting
    def template(self, template_id: str) -> tuple[str, dict[str, Any], builtins.list[str]]:
        found = self.catalog.template(template_id)
        if found is None:
            raise NotFound(f"template {template_id!r} not found")
        return found

    def _memory_in_use(self) -> int:
        return sum(r.memory_mb for r in self._records.values() if r.state in _HOLDS_MEMORY)

    def _reserve(self, memory_mb: int) -> None:
        used = self._memory_in_use()
        if used + memory_mb > self.memory_budget_mb:
            raise Unavailable(
                f"not enough memory on this node: {used} MiB of {self.memory_budget_mb} MiB "
                f"in use, {memory_mb} MiB requested"
            )

    def _spec(self, r: SandboxRecord) -> SandboxSpec:
        layers = [self.storage.layers.path(d) for d in r.layers]
        for d, p in zip(r.layers, layers, strict=True):
            if not p.is_dir():
                raise Unavailable(f"layer {d} of sandbox {r.sandbox_id} is missing on this node")
        bundle = self._bundle
        return SandboxSpec(
            sandbox_id=r.sandbox_id,
            layers=layers,
            args=bundle.init_args(port=ENVD_PORT),
            env=bundle.init_env(),
            mounts=[Mount(bundle.host_path, bundle.MOUNT, readonly=True)],
            cpu_count=r.cpu_count,
            memory_mb=r.memory_mb,
            hostname="sandbox",
            upper=Path(r.upper) if r.upper else None,
        )

    async def _boot(
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
        its own re-initialisation); `init=False` skips /init for a plain resume."""
        run = run_to_squash(r.layers, 0)
        if run is not None:  # past what one overlay mount takes: cannot wait for later
            with t.stage("squash"):
                await self._apply_squash(r, run, await self.squasher.squash(run, r.sandbox_id))
        spec = self._spec(r)
        inst: Instance | None = None
        with t.stage("queue") if self._boot_slots.locked() else contextlib.nullcontext():
            await self._boot_slots.acquire()
        try:
            if image is None:
                with t.stage("boot"):
                    inst = await self.runtime.create(spec, reuse=reuse)
            else:
                with t.stage("restore"):
                    inst = await self.runtime.restore(spec, image, reuse=reuse)
            r.instance = inst.to_json()
            with t.stage("envd-ready"):
                await self.envd.wait_ready(inst.address, ENVD_PORT)
            if init:
                with t.stage("envd-init"):
                    await self.envd.init(
                        inst.address,
                        ENVD_PORT,
                        token=r.envd_access_token,
                        env_vars={**(r.boot.get("env") or {}), **r.env_vars},
                        user=r.boot.get("user"),
                        workdir=r.boot.get("workdir"),
                        current_token=init_from,
                    )
        except BaseException as e:
            if inst is not None:
                await self._destroy_quietly(inst)
            r.instance = None
            if isinstance(e, AenvError | asyncio.CancelledError):
                raise
            raise RuntimeFailure(
                f"sandbox {r.sandbox_id} failed to start: {type(e).__name__}: {e}"
            ) from e
        finally:
            self._boot_slots.release()
        if r.retired_layers:  # the new container runs on the squashed stack
            gone = [d for d in r.retired_layers if d not in r.layers]
            await asyncio.to_thread(self.storage.unhold, "sandbox", r.sandbox_id, gone)
            r.retired_layers = []
        return inst

    # ------------------------------------------------------------------ squashing
    def _squash_later(self, r: SandboxRecord) -> None:
        run = run_to_squash(r.layers, self.settings.squash_layers)
        if run is not None:
            self._spawn(self._squash_in_background(r.sandbox_id, run))

    async def _squash_in_background(self, sandbox_id: str, run: builtins.list[str]) -> None:
        try:
            merged = await self.squasher.squash(run, sandbox_id)
        except Exception:
            log.exception("squashing the layers of %s failed", sandbox_id)
            return
        async with self._lock(sandbox_id):
            r = self._records.get(sandbox_id)
            if r is not None and r.state not in (State.KILLING, State.KILLED, State.LOST):
                await self._apply_squash(r, run, merged)

    async def _apply_squash(self, r: SandboxRecord, run: builtins.list[str], merged: str) -> None:
        new = replace_run(r.layers, run, merged)
        if new is None:
            return
        await asyncio.to_thread(self.storage.hold, "sandbox", r.sandbox_id, [merged])
        r.retired_layers = sorted(set(r.retired_layers) | (set(run) - set(new)))
        r.layers = new
        await self._save(r)
        log.info("sandbox %s: %d layers squashed into %s", r.sandbox_id, len(run), merged)

    async def _destroy_quietly(self, inst: Instance) -> None:
        try:
            await self.runtime.destroy(inst)
        except Exception:
            log.exception("destroying %s failed", inst.container_id)

    def _new_record(
        self,
        *,
        template_id: str,
        alias: str | None,
        doc: dict[str, Any],
        req: CreateRequest,
        timeout: int,
        cpu: int,
        mem: int,
        layers: builtins.list[str] | None = None,
    ) -> SandboxRecord:
        now = utcnow()
        sandbox_id = new_id()
        return SandboxRecord(
            sandbox_id=sandbox_id,
            template_id=template_id,
            alias=alias,
            client_id="aenv",
            started_at=now,
            end_at=now + timedelta(seconds=timeout),
            cpu_count=cpu,
            memory_mb=mem,
            disk_mb=self.settings.default_disk_mb,
            state=State.CREATING,
            envd_version=ENVD_VERSION,
            envd_access_token=secrets.token_urlsafe(24) if req.secure else "",
            metadata=dict(req.metadata),
            env_vars=dict(req.env_vars),
            auto_pause=req.auto_pause,
            auto_pause_memory=req.auto_pause_memory,
            auto_resume=req.auto_resume,
            allow_internet_access=req.allow_internet_access,
            layers=list(doc["layers"] if layers is None else layers),
            upper=str(self.storage.new_upper(sandbox_id)),
            # The template's own layers: a sandbox restored from a boot snapshot runs on more.
            boot={
                **{k: doc.get(k) for k in ("env", "user", "workdir")},
                "from_layers": list(doc["layers"]),
            },
        )

    async def register_template(
        self, template_id: str, doc: dict[str, Any], names: builtins.list[str]
    ) -> None:
        """Adds (or replaces) a template: catalog entry, layer references, and its durable
        copy in the repository (published in the background)."""
        await asyncio.to_thread(self.storage.hold, "template", template_id, list(doc["layers"]))
        await asyncio.to_thread(self.catalog.put_template, template_id, doc, names)
        if self.durable is not None and not doc.get("internal"):
            self.durable.publish_later(template_id, doc, names)

    async def create(self, req: CreateRequest, timings: Timings | None = None) -> SandboxRecord:
        t = timings or Timings()
        s = self.settings
        template_id, doc, names = await asyncio.to_thread(self.template, req.template_id)
        timeout = s.default_timeout if req.timeout is None else req.timeout
        check_timeout(timeout, self.settings)
        if doc.get("checkpoint"):
            # A snapshot carries memory: the sandbox continues from it with its recorded size.
            cpu, mem = int(doc["cpu_count"]), int(doc["memory_mb"])
        else:
            cpu = req.cpu_count or int(doc.get("cpu_count") or s.default_cpu_count)
            mem = req.memory_mb or int(doc.get("memory_mb") or s.default_memory_mb)
        alias = req.template_id if req.template_id in names else (names[0] if names else None)
        warm = self._take_warm(template_id, doc, cpu, mem)
        if warm is not None:
            adopted = await self._adopt_warm(warm, req, alias, timeout, t)
            if adopted is not None:
                return adopted
        self._reserve(mem)
        boot = self._boot_snapshot_for(template_id, doc, cpu, mem)
        r = self._new_record(
            template_id=template_id,
            alias=alias,
            doc=doc,
            req=req,
            timeout=timeout,
            cpu=cpu,
            mem=mem,
            layers=None if boot is None else list(boot["layers"]),
        )
        self._records[r.sandbox_id] = r
        try:
            await asyncio.to_thread(self.storage.hold, "sandbox", r.sandbox_id, r.layers)
            if self.durable is not None:
                with t.stage("fetch"):
                    await self.durable.ensure_layers(template_id, doc)
            if doc.get("checkpoint"):
                if self.durable is not None:
                    with t.stage("fetch"):
                        image = await self.durable.image_for(template_id, doc)
                else:
                    image = self.storage.image_dir(str(doc["checkpoint"]))
                await self._boot(r, t, image=image, init_from=doc.get("envd_token") or None)
            elif boot is not None:
                await self._boot(r, t, image=self.storage.image_dir(str(boot["checkpoint"])))
            else:
                await self._boot(r, t)
        except BaseException:
            self._records.pop(r.sandbox_id, None)
            await self._forget(r)
            raise
        r.state = State.RUNNING
        # The clock starts at readiness, so a slow boot doesn't eat the user's timeout.
        r.end_at = utcnow() + timedelta(seconds=timeout)
        await self._save(r)
        self._squash_later(r)
        return r

    # ------------------------------------------------------------------ warm pool
    def _take_warm(
        self, template_id: str, doc: dict[str, Any], cpu: int, mem: int
    ) -> SandboxRecord | None:
        if doc.get("checkpoint"):
            return None
        for i, w in enumerate(self._warm):
            if (w.template_id, w.cpu_count, w.memory_mb) == (template_id, cpu, mem) and (
                w.boot.get("from_layers") == list(doc["layers"])
            ):
                return self._warm.pop(i)
        return None

    async def _adopt_warm(
        self, w: SandboxRecord, req: CreateRequest, alias: str | None, timeout: int, t: Timings
    ) -> SandboxRecord | None:
        """Turns a pre-booted sandbox into the requested one: only envd's /init is left."""
        self._refill_warm(delay=REFILL_DELAY)
        w.alias = alias
        w.metadata = dict(req.metadata)
        w.env_vars = dict(req.env_vars)
        w.envd_access_token = secrets.token_urlsafe(24) if req.secure else ""
        w.auto_pause, w.auto_pause_memory = req.auto_pause, req.auto_pause_memory
        w.auto_resume, w.allow_internet_access = req.auto_resume, req.allow_internet_access
        assert w.instance is not None
        try:
            with t.stage("pool-init"):
                await self.envd.init(
                    str(w.instance["address"]),
                    ENVD_PORT,
                    token=w.envd_access_token,
                    env_vars={**(w.boot.get("env") or {}), **w.env_vars},
                    user=w.boot.get("user"),
                    workdir=w.boot.get("workdir"),
                )
        except Exception:
            log.exception("a pre-booted sandbox could not be initialised; booting a new one")
            self._records.pop(w.sandbox_id, None)
            await self._destroy_quietly(Instance.from_json(w.instance))
            await self._forget(w)
            return None
        w.state = State.RUNNING
        w.started_at = utcnow()
        w.end_at = w.started_at + timedelta(seconds=timeout)
        await self._save(w)
        return w

    def _refill_warm(self, delay: float = 0.0) -> None:
        if self._closing:
            return  # (with a pool size of 0 the task still makes the boot snapshot)
        if self._warm_task is None or self._warm_task.done():
            self._warm_task = asyncio.create_task(self._fill_warm(delay), name="aenv-warm")

    async def _fill_warm(self, delay: float = 0.0) -> None:
        # After a pool sandbox was handed out, its first commands usually follow at once:
        # the refill (a restore, CPU-bound) waits instead of competing with them.
        await asyncio.sleep(delay)
        await self._fill_pool()
        # After the first fill, so a node that just started has its pool ready soonest.
        await self._prepare_boot_snapshots()
        await self._fill_pool()

    async def _fill_pool(self) -> None:
        while len(self._warm) < self.settings.sandbox_pool_size and not self._closing:
            found = await asyncio.to_thread(self.catalog.template, "base")
            if found is None:
                return
            tid, doc, names = found
            cpu = int(doc.get("cpu_count") or self.settings.default_cpu_count)
            mem = int(doc.get("memory_mb") or self.settings.default_memory_mb)
            try:
                self._reserve(mem)
            except AenvError:
                return
            boot = self._boot_snapshot_for(tid, doc, cpu, mem)
            try:
                r = await self._preboot(
                    tid, doc, cpu, mem, alias=names[0] if names else None, boot=boot
                )
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("pre-booting a sandbox failed")
                await asyncio.sleep(5)
                continue
            self._warm.append(r)

    async def _preboot(
        self,
        template_id: str,
        doc: dict[str, Any],
        cpu: int,
        mem: int,
        *,
        alias: str | None,
        boot: dict[str, Any] | None,
        timings: Timings | None = None,
    ) -> SandboxRecord:
        """A sandbox of the template for no one yet (memory reserved by the caller): booted,
        or restored from the boot snapshot `boot`; envd not initialised; warmed up. What it
        left behind is gone if it fails."""
        t = timings or Timings()
        r = self._new_record(
            template_id=template_id,
            alias=alias,
            doc=doc,
            req=CreateRequest(),
            timeout=self.settings.default_timeout,
            cpu=cpu,
            mem=mem,
            layers=None if boot is None else list(boot["layers"]),
        )
        self._records[r.sandbox_id] = r
        try:
            await asyncio.to_thread(self.storage.hold, "sandbox", r.sandbox_id, r.layers)
            image = None if boot is None else self.storage.image_dir(str(boot["checkpoint"]))
            await self._boot(r, t, image=image, init=False)
            # Also after a restore: the files bash and envd map are re-opened lazily.
            await self._warm_up(r)
        except BaseException:
            self._records.pop(r.sandbox_id, None)
            await self._forget(r)
            raise
        return r

    async def _prepare_boot_snapshots(self) -> None:
        """Hook run once the pool was first filled (the boot snapshot, in lifecycle)."""

    def _boot_snapshot_for(
        self, template_id: str, doc: dict[str, Any], cpu: int, mem: int
    ) -> dict[str, Any] | None:
        """The boot snapshot document to restore a new sandbox of this template and size
        from, if there is a current one; asks for one to be made otherwise."""
        if not self.settings.boot_snapshots or doc.get("checkpoint") or doc.get("internal"):
            return None  # (internal: a build step's transient template, used once)
        key = (template_id, cpu)
        found = self._boot_snapshots.get(key)
        if found is not None and found[1].get("boot_from_layers") == list(doc["layers"]):
            return found[1]
        if key not in self._boot_tried and len(self._boot_tried) < MAX_BOOT_SNAPSHOTS:
            default_mem = int(doc.get("memory_mb") or self.settings.default_memory_mb)
            self._spawn(self._ensure_boot_snapshot(template_id, cpu, default_mem))
        return None

    async def _ensure_boot_snapshot(self, template_id: str, cpu: int, mem: int) -> None:
        """Hook: makes the boot snapshot of that shape (lifecycle)."""

    async def _warm_up(self, r: SandboxRecord) -> None:
        """Runs one login shell in a pre-booted sandbox: the first command a user runs is
        otherwise ~45 ms slower (envd's process code and bash's files are read through
        gVisor's gofer for the first time). Best effort: an image without bash just skips."""
        assert r.instance is not None
        rpc = self.envd.rpc(str(r.instance["address"]), ENVD_PORT, "")
        try:
            await rpc.run("/bin/bash", ["-l", "-c", "true"], user=r.boot.get("user"), timeout=10)
        except Exception as e:
            log.debug("warm-up of %s: %s", r.sandbox_id, e)

    # ------------------------------------------------------------------ kill / timeouts
    async def kill(self, sandbox_id: str) -> None:
        r = self._records.get(sandbox_id)
        if r is None or r.state in (State.KILLED, State.KILLING, State.CREATING):
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        async with self._lock(sandbox_id):
            if r.state in (State.KILLED, State.KILLING):
                raise NotFound(f"sandbox {sandbox_id!r} not found")
            r.state = State.KILLING
            if r.instance:
                await self._destroy_quietly(Instance.from_json(r.instance))
            r.state = State.KILLED
            r.instance = None
            self._records.pop(sandbox_id, None)
            self._locks.pop(sandbox_id, None)
            await self.catalog.adelete_sandbox(sandbox_id)
            await self._forget(r)

    async def _forget(self, r: SandboxRecord) -> None:
        """Drops what a killed sandbox left on disk (its uppers, a hibernation image)."""
        await asyncio.to_thread(self.storage.remove_sandbox, r.sandbox_id)
        await asyncio.to_thread(self.storage.release, "sandbox", r.sandbox_id)
        if r.paused_state and r.paused_state.get("image"):
            await self._drop_image(str(r.paused_state["image"]))

    async def _drop_image(self, name: str) -> None:
        """Removes a hibernation image from the repository and the node."""
        if self.durable is not None:
            await self.durable.forget(name)  # first: a publish in flight still reads it
        await asyncio.to_thread(self.storage.remove_image, name)

    async def set_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord:
        r = self.get(sandbox_id)
        check_timeout(timeout, self.settings)
        r.end_at = utcnow() + timedelta(seconds=timeout)
        await self._save(r)
        return r

    async def refresh(self, sandbox_id: str, duration: int | None) -> SandboxRecord:
        r = self.get(sandbox_id)
        d = self.settings.default_timeout if duration is None else duration
        if d < 0 or d > 3600:
            raise BadRequest("duration must be between 0 and 3600 seconds")
        r.end_at = max(r.end_at, utcnow() + timedelta(seconds=d))
        await self._save(r)
        return r
