"""The orchestrator: the sandbox lifecycle state machine over a runtime and the catalog.

It owns the in-memory table of sandboxes (persisted to the catalog on every change), one
lock per sandbox so lifecycle operations on one sandbox never interleave, and the TTL loop.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import secrets
import string
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from .. import ENVD_VERSION
from ..config import Settings
from ..errors import AenvError, BadRequest, Conflict, Gone, NotFound, RuntimeFailure, Unavailable
from ..runtime.base import Instance, Mount, Runtime, SandboxSpec
from .catalog import Catalog
from .envd_client import EnvdClient
from .models import CreateRequest, SandboxRecord, State, utcnow

log = logging.getLogger("aenv.orchestrator")

ENVD_PORT = 49983
_ID_ALPHABET = string.ascii_lowercase + string.digits
# States in which the sandbox still holds runtime resources.
_LIVE = {State.RUNNING, State.PAUSED, State.CREATING, State.PAUSING, State.RESUMING}


def new_sandbox_id() -> str:
    # E2B-style: 20 lowercase alphanumerics; no '-' so `{port}-{id}.{domain}` parses.
    return "i" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(19))


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
        return ", ".join(f"{k};dur={v:.1f}" for k, v in self.stages.items())


class Orchestrator:
    def __init__(
        self,
        settings: Settings,
        catalog: Catalog,
        runtime: Runtime,
        *,
        layer_path: Any,
        bundle: Any,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.runtime = runtime
        # `layer_path(digest) -> Path` (images.layers.LayerStore.path) and the envd bundle
        # (runtime.bundle.EnvdBundle): injected so tests and other backends can swap them.
        self._layer_path = layer_path
        self._bundle = bundle
        self.envd = EnvdClient()
        self._records: dict[str, SandboxRecord] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._ttl_task: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[Any]] = set()

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
            if r.state in (State.KILLED,):
                await self.catalog.adelete_sandbox(r.sandbox_id)
                continue
            if r.instance and r.instance["container_id"] in recovered:
                inst = recovered[r.instance["container_id"]]
                r.instance = inst.to_json()
                if r.state not in (State.RUNNING, State.PAUSED):
                    r.state = State.RUNNING
                log.info("recovered sandbox %s (%s)", r.sandbox_id, r.state)
            elif r.state in _LIVE:
                r.state = State.LOST
                r.instance = None
                r.note = "the sandbox was running when the server stopped and could not be recovered"
                log.warning("sandbox %s lost across the restart", r.sandbox_id)
            self._records[r.sandbox_id] = r
            await self.catalog.aput_sandbox(r)
        self._ttl_task = asyncio.create_task(self._ttl_loop(), name="aenv-ttl")

    async def close(self) -> None:
        if self._ttl_task:
            self._ttl_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ttl_task
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        await self.runtime.close()
        await self.envd.close()

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        lock = self._locks.get(sandbox_id)
        if lock is None:
            lock = self._locks[sandbox_id] = asyncio.Lock()
        return lock

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

    # ------------------------------------------------------------------ create
    def _template(self, template_id: str) -> tuple[str, dict[str, Any], builtins.list[str]]:
        found = self.catalog.template(template_id)
        if found is None:
            raise NotFound(f"template {template_id!r} not found")
        return found

    def _spec(self, sandbox_id: str, doc: dict[str, Any], cpu: int, mem: int) -> SandboxSpec:
        layers = [Path(self._layer_path(d)) for d in doc["layers"]]
        for p in layers:
            if not p.is_dir():
                raise Unavailable(f"layer {p.name} of the template is missing on this node")
        bundle = self._bundle
        return SandboxSpec(
            sandbox_id=sandbox_id,
            layers=layers,
            args=bundle.init_args(port=ENVD_PORT),
            env=bundle.init_env(),
            mounts=[Mount(bundle.host_path, bundle.MOUNT, readonly=True)],
            cpu_count=cpu,
            memory_mb=mem,
            hostname="sandbox",
        )

    async def create(self, req: CreateRequest, timings: Timings | None = None) -> SandboxRecord:
        t = timings or Timings()
        s = self.settings
        template_id, doc, names = await asyncio.to_thread(self._template, req.template_id)
        timeout = s.default_timeout if req.timeout is None else req.timeout
        if timeout < 0 or timeout > s.max_timeout:
            raise BadRequest(f"timeout must be between 0 and {s.max_timeout} seconds")
        cpu = req.cpu_count or int(doc.get("cpu_count") or s.default_cpu_count)
        mem = req.memory_mb or int(doc.get("memory_mb") or s.default_memory_mb)
        sandbox_id = new_sandbox_id()
        now = utcnow()
        alias = req.template_id if req.template_id in names else (names[0] if names else None)
        record = SandboxRecord(
            sandbox_id=sandbox_id,
            template_id=template_id,
            alias=alias,
            client_id="aenv",
            started_at=now,
            end_at=now + timedelta(seconds=timeout),
            cpu_count=cpu,
            memory_mb=mem,
            disk_mb=s.default_disk_mb,
            state=State.CREATING,
            envd_version=ENVD_VERSION,
            envd_access_token=secrets.token_urlsafe(24) if req.secure else "",
            metadata=dict(req.metadata),
            env_vars=dict(req.env_vars),
            auto_pause=req.auto_pause,
            auto_pause_memory=req.auto_pause_memory,
            auto_resume=req.auto_resume,
            allow_internet_access=req.allow_internet_access,
        )
        spec = self._spec(sandbox_id, doc, cpu, mem)
        self._records[sandbox_id] = record
        inst: Instance | None = None
        try:
            with t.stage("boot"):
                inst = await self.runtime.create(spec)
            record.instance = inst.to_json()
            with t.stage("envd"):
                await self.envd.wait_ready(inst.address, ENVD_PORT)
                await self.envd.init(
                    inst.address,
                    ENVD_PORT,
                    token=record.envd_access_token,
                    env_vars={**(doc.get("env") or {}), **record.env_vars},
                    user=doc.get("user"),
                    workdir=doc.get("workdir"),
                )
        except BaseException as e:
            self._records.pop(sandbox_id, None)
            if inst is not None:
                await self._destroy_quietly(inst)
            if isinstance(e, AenvError):
                raise
            if isinstance(e, asyncio.CancelledError):
                raise
            raise RuntimeFailure(f"sandbox failed to start: {e}") from e
        record.state = State.RUNNING
        # Restart the clock from readiness, so a slow boot doesn't eat the user's timeout.
        record.end_at = utcnow() + timedelta(seconds=timeout)
        await self.catalog.aput_sandbox(record)
        record_timings(record, t)
        return record

    async def _destroy_quietly(self, inst: Instance) -> None:
        try:
            await self.runtime.destroy(inst)
        except Exception:
            log.exception("destroying %s failed", inst.container_id)

    # ------------------------------------------------------------------ kill / timeouts
    async def kill(self, sandbox_id: str) -> None:
        r = self._records.get(sandbox_id)
        if r is None or r.state in (State.KILLED, State.KILLING, State.CREATING):
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        async with self._lock(sandbox_id):
            if r.state in (State.KILLED, State.KILLING):
                raise NotFound(f"sandbox {sandbox_id!r} not found")
            r.state = State.KILLING
            inst = Instance.from_json(r.instance) if r.instance else None
            if inst is not None:
                await self._destroy_quietly(inst)
            r.state = State.KILLED
            r.instance = None
            self._records.pop(sandbox_id, None)
            self._locks.pop(sandbox_id, None)
            await self.catalog.adelete_sandbox(sandbox_id)

    async def set_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord:
        r = self.get(sandbox_id)
        if timeout < 0 or timeout > self.settings.max_timeout:
            raise BadRequest(f"timeout must be between 0 and {self.settings.max_timeout} seconds")
        r.end_at = utcnow() + timedelta(seconds=timeout)
        await self.catalog.aput_sandbox(r)
        return r

    async def refresh(self, sandbox_id: str, duration: int | None) -> SandboxRecord:
        r = self.get(sandbox_id)
        d = self.settings.default_timeout if duration is None else duration
        if d < 0 or d > 3600:
            raise BadRequest("duration must be between 0 and 3600 seconds")
        r.end_at = max(r.end_at, utcnow() + timedelta(seconds=d))
        await self.catalog.aput_sandbox(r)
        return r

    async def _ttl_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = utcnow()
            for r in list(self._records.values()):
                if r.end_at > now:
                    continue
                try:
                    if r.state is State.RUNNING:
                        if r.auto_pause:
                            log.info("sandbox %s timed out: pausing", r.sandbox_id)
                            await self.pause(r.sandbox_id, memory=r.auto_pause_memory)
                        else:
                            log.info("sandbox %s timed out: killing", r.sandbox_id)
                            await self.kill(r.sandbox_id)
                except AenvError as e:
                    log.info("timeout handling of %s: %s", r.sandbox_id, e.message)
                except Exception:
                    log.exception("timeout handling of %s failed", r.sandbox_id)

    # ------------------------------------------------------------------ pause / resume
    async def pause(self, sandbox_id: str, memory: bool = True, timings: Timings | None = None) -> None:
        t = timings or Timings()
        r = self.get(sandbox_id)
        async with self._lock(sandbox_id):
            r = self.get(sandbox_id)
            if r.state is State.PAUSED:
                raise Conflict(f"sandbox {sandbox_id!r} is already paused")
            if r.state is not State.RUNNING or r.instance is None:
                raise Conflict(f"sandbox {sandbox_id!r} cannot be paused in state {r.state}")
            with t.stage("freeze"):
                await self.runtime.freeze(Instance.from_json(r.instance))
            r.state = State.PAUSED
            r.paused_state = {"tier": "frozen", "paused_at": utcnow().isoformat()}
            await self.catalog.aput_sandbox(r)
        record_timings(r, t)

    async def _resume_locked(self, r: SandboxRecord, t: Timings) -> None:
        assert r.instance is not None
        with t.stage("thaw"):
            await self.runtime.thaw(Instance.from_json(r.instance))
        r.state = State.RUNNING
        r.paused_state = None

    async def connect(
        self,
        sandbox_id: str,
        timeout: int | None,
        memory: bool | None = None,
        timings: Timings | None = None,
    ) -> tuple[SandboxRecord, bool]:
        t = timings or Timings()
        r = self.get(sandbox_id)
        async with self._lock(sandbox_id):
            r = self.get(sandbox_id)
            resumed = False
            if r.state is State.PAUSED:
                await self._resume_locked(r, t)
                resumed = True
                ttl = self.settings.default_timeout if timeout is None else timeout
                r.end_at = utcnow() + timedelta(seconds=ttl)
            elif timeout is not None:
                r.end_at = max(r.end_at, utcnow() + timedelta(seconds=timeout))
            await self.catalog.aput_sandbox(r)
        record_timings(r, t)
        return r, resumed

    # ------------------------------------------------------------------ data plane
    async def resolve(self, sandbox_id: str, port: int) -> tuple[str, int]:
        r = self._records.get(sandbox_id)
        if r is None or r.state not in (State.RUNNING, State.PAUSED, State.RESUMING):
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        if r.state is not State.RUNNING:
            if not r.auto_resume:
                raise Gone(f"sandbox {sandbox_id!r} is paused")
            await self.connect(sandbox_id, max(300, self.settings.default_timeout))
        if r.address is None:
            raise NotFound(f"sandbox {sandbox_id!r} is not running")
        return r.address, port


def record_timings(r: SandboxRecord, t: Timings) -> None:
    # Read by the API for the Server-Timing header; not persisted.
    r.__dict__["timings"] = t
