"""The template builder: E2B's build flow over the orchestrator, one background task per build.

Flow (protocol §2.3): `request()` (POST /v3/templates) makes a build record in `waiting`;
`start()` (POST /v2/templates/{id}/builds/{bid}) validates the steps and runs `_run` in a
task; the status route reads `status()` with `logsOffset`.

A build (at most `concurrency` at once; the others wait):
  base      pull `fromImage` (credentials from `fromImageRegistry`) or take the layers of
            `fromTemplate`; the image config seeds ENV, WORKDIR and USER
  steps     ENV / WORKDIR / USER change the build state. RUN and COPY each boot a build
            sandbox on the current layer stack (as the build USER, in WORKDIR, with ENV),
            do their work, and commit: `export_layers` seals the sandbox's upper as a new
            layer on top. Per-step cache: key = hash(parent layers, step, files hash, build
            state) -> that layer; a hit skips the step (unless `force`, skip_cache, or the
            layer was evicted)
  finalize  with startCmd (or a lone readyCmd): boot on the final stack, start startCmd in
            the background, poll readyCmd (every 0.5-2 s, up to `ready_timeout`), then
            `orchestrator.snapshot(..., template_id=<templateID>)` WITH memory: sandboxes
            created from the template restore that snapshot, so the started process is
            running in each of them. Without: the final stack (+ env/user/workdir) is the
            template doc, booted cold.
The template keeps its id across builds (same name: same template); a new build replaces
the doc. Failures end in `error` with `reason.message` naming the step; build sandboxes are
killed whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..config import Settings
from ..errors import AenvError, BadRequest, Conflict, NotFound
from ..images.cache import holder
from ..images.pull import LayerProgress
from ..orchestrator.envd_client import EnvdRpc
from ..orchestrator.lifecycle import Orchestrator
from ..orchestrator.models import CreateRequest, SandboxRecord, utcnow
from ..orchestrator.service import ENVD_PORT, new_id
from . import stack, steps
from .files import BuildFiles
from .images import Images
from .spec import (
    LAYER_STEPS,
    BuildSpec,
    BuildState,
    Step,
    apply_state_step,
    cache_key,
    parse_spec,
)
from .store import LEVELS, BuildRecord, BuildStore, LogEntry

log = logging.getLogger("aenv.builds")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")
BUILD_SANDBOX_TTL = 6 * 3600
STEP_TIMEOUT = 3600.0
READY_TIMEOUT = 120.0
READY_CHECK_TIMEOUT = 30.0
META_BUILD = "aenv.build"


class BuildFailed(Exception):
    def __init__(self, message: str, step: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.step = step


def split_name(name: str) -> tuple[str, str | None]:
    """`name:tag` -> (name, tag); a `:` inside a registry-like host part is not a tag."""
    base, sep, tag = name.rpartition(":")
    if sep and tag and "/" not in tag and base:
        return base, tag
    return name, None


@dataclass
class ActiveBuild:
    record: BuildRecord
    spec: BuildSpec | None = None
    logs: list[LogEntry] = field(default_factory=list)
    flushed: int = 0
    task: asyncio.Task[None] | None = None
    sandboxes: set[str] = field(default_factory=set)
    step: str | None = None


class Builder:
    def __init__(
        self,
        settings: Settings,
        orchestrator: Orchestrator,
        *,
        images: Images | None = None,
        concurrency: int = 2,
        ready_timeout: float = READY_TIMEOUT,
    ) -> None:
        self.settings = settings
        self.orch = orchestrator
        self.images = images or Images(orchestrator)
        self.store = BuildStore(settings.home / "builds.db")
        self.files = BuildFiles(settings.home / "build-files", settings.effective_api_key)
        self.ready_timeout = ready_timeout
        self._active: dict[str, ActiveBuild] = {}
        self._sem = asyncio.Semaphore(max(1, concurrency))

    # ------------------------------------------------------------------ node lifecycle
    async def start(self) -> None:
        try:
            await self._cleanup()
        except Exception:
            log.exception("cleaning up after the builds of an earlier server process failed")

    async def _cleanup(self) -> None:
        """Ends what a previous server process left: unfinished builds, their sandboxes
        and transient internal templates."""
        for b in await asyncio.to_thread(self.store.unfinished):
            b.status = "error"
            b.doc["reason"] = {"message": "the build was interrupted by a server restart"}
            b.doc["finished"] = time.time()
            await asyncio.to_thread(self.store.put, b)
        for r in self.orch.list():
            if r.metadata.get(META_BUILD):
                with contextlib.suppress(AenvError):
                    await self.orch.kill(r.sandbox_id)
        for tid, doc, _names in await asyncio.to_thread(self.orch.catalog.templates):
            if doc.get("internal") and doc.get("kind") in ("build-step", "image"):
                await asyncio.to_thread(self.images._unregister, tid)

    async def close(self) -> None:
        tasks = [ab.task for ab in self._active.values() if ab.task and not ab.task.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.store.close()

    # ------------------------------------------------------------------ requests
    def _template_for_name(self, name: str) -> str | None:
        """The id of the template `name` belongs to (catalog, or a build in flight)."""
        found = self.orch.catalog.template(name)
        if found is not None:
            tid, doc, _ = found
            if doc.get("internal"):
                return None
            if tid == "base" or doc.get("kind") == "snapshot":
                raise Conflict(
                    f"{name!r} is the name of a {'snapshot' if tid != 'base' else 'default template'}"
                    "; pick another template name"
                )
            return tid
        for b in self.store.all():
            if name in b.names:
                return b.template_id
        return None

    async def request(
        self,
        name: str,
        *,
        tags: list[str] | None = None,
        cpu_count: int | None = None,
        memory_mb: int | None = None,
    ) -> BuildRecord:
        if not _NAME_RE.match(name):
            raise BadRequest(
                f"invalid template name {name!r}: use letters, digits and _.:/- (max 128 chars)"
            )
        base, tag = split_name(name)
        all_tags = [t for t in ([tag] if tag else []) + list(tags or []) if t]
        for t in all_tags:
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", t):
                raise BadRequest(f"invalid tag {t!r}")
        tid = await asyncio.to_thread(self._template_for_name, base)
        if tid is None:
            tid = new_id("t")
        names = [base, *[f"{base}:{t}" for t in all_tags]]
        now = time.time()
        record = BuildRecord(
            build_id=str(uuid.uuid4()),
            template_id=tid,
            status="waiting",
            created=now,
            updated=now,
            doc={
                "names": names,
                "name": base,
                "tags": all_tags,
                "cpu_count": cpu_count or self.settings.default_cpu_count,
                "memory_mb": memory_mb or self.settings.default_memory_mb,
            },
        )
        await asyncio.to_thread(self.store.put, record)
        return record

    def get_build(self, template_id: str, build_id: str) -> BuildRecord:
        ab = self._active.get(build_id)
        b = ab.record if ab else self.store.get(build_id)
        if b is None or template_id not in (b.template_id, *b.names):
            raise NotFound(f"build {build_id!r} of template {template_id!r} not found")
        return b

    async def start_build(self, template_id: str, build_id: str, raw: dict[str, Any]) -> None:
        b = await asyncio.to_thread(self.get_build, template_id, build_id)
        if b.status != "waiting" or build_id in self._active:
            raise Conflict(f"build {build_id} was already started (it is {b.status})")
        spec = parse_spec(raw)
        for i, step in enumerate(spec.steps, 1):
            if step.type == "COPY" and not self.files.present(str(step.files_hash)):
                raise BadRequest(
                    f"step {i} {step.describe()}: its files ({step.files_hash}) were not uploaded"
                )
        b.doc["spec"] = spec.to_json()
        ab = ActiveBuild(record=b, spec=spec)
        self._active[build_id] = ab
        await asyncio.to_thread(self.store.put, b)
        self._log(ab, "info", f"build {build_id} of template {b.template_id} queued")
        ab.task = asyncio.create_task(self._run(ab), name=f"aenv-build-{build_id}")

    def status(
        self, template_id: str, build_id: str, offset: int, limit: int, level: str | None
    ) -> tuple[BuildRecord, list[LogEntry]]:
        b = self.get_build(template_id, build_id)
        ab = self._active.get(build_id)
        entries = list(ab.logs) if ab else self.store.logs(build_id)
        if level:
            floor = LEVELS.index(level)
            entries = [e for e in entries if LEVELS.index(e.level) >= floor]
        return b, entries[max(0, offset) : max(0, offset) + max(1, limit)]

    def builds(self, template_id: str) -> list[BuildRecord]:
        out = self.store.for_template(template_id)
        return [self._active[b.build_id].record if b.build_id in self._active else b for b in out]

    def by_template(self) -> dict[str, list[BuildRecord]]:
        """Every template's builds, newest first."""
        out: dict[str, list[BuildRecord]] = {}
        for b in self.store.all():
            ab = self._active.get(b.build_id)
            out.setdefault(b.template_id, []).append(ab.record if ab else b)
        return out

    def pending_templates(self) -> list[BuildRecord]:
        """The newest build of every template that has builds."""
        return [builds[0] for builds in self.by_template().values()]

    async def delete_template(self, template_id: str) -> bool:
        """Cancels the template's builds and forgets them; True if there were any."""
        b_all = await asyncio.to_thread(self.store.for_template, template_id)
        if not b_all:  # a name of a template that only has builds so far
            named = [b for b in await asyncio.to_thread(self.store.all) if template_id in b.names]
            if not named:
                return False
            template_id = named[0].template_id
            b_all = await asyncio.to_thread(self.store.for_template, template_id)
        tasks = []
        for b in b_all:
            ab = self._active.get(b.build_id)
            if ab and ab.task and not ab.task.done():
                ab.task.cancel()
                tasks.append(ab.task)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self.store.delete_template, template_id)
        return bool(b_all)

    # ------------------------------------------------------------------ logs
    def _log(self, ab: ActiveBuild, level: str, message: str, step: str | None = None) -> None:
        ab.logs.append(LogEntry(len(ab.logs), time.time(), level, message, step or ab.step))

    async def _flush(self, ab: ActiveBuild) -> None:
        new = ab.logs[ab.flushed :]
        if new:
            await asyncio.to_thread(self.store.add_logs, ab.record.build_id, new)
            ab.flushed += len(new)

    # ------------------------------------------------------------------ the build
    async def _run(self, ab: ActiveBuild) -> None:
        b = ab.record
        bid = b.build_id
        t0 = time.monotonic()
        try:
            async with self._sem:
                b.status = "building"
                await asyncio.to_thread(self.store.put, b)
                assert ab.spec is not None
                await self._build(ab, ab.spec)
            b.status = "ready"
            self._log(ab, "info", f"build finished in {time.monotonic() - t0:.1f}s", "finalize")
        except BuildFailed as e:
            b.status = "error"
            b.doc["reason"] = {"message": e.message, **({"step": e.step} if e.step else {})}
            self._log(ab, "error", e.message, e.step)
        except asyncio.CancelledError:
            b.status = "error"
            b.doc["reason"] = {"message": "the build was cancelled"}
            self._log(ab, "error", "the build was cancelled")
        except AenvError as e:
            b.status = "error"
            msg = f"step {ab.step} failed: {e.message}" if ab.step else e.message
            b.doc["reason"] = {"message": msg, **({"step": ab.step} if ab.step else {})}
            self._log(ab, "error", msg)
        except Exception as e:
            log.exception("build %s failed", bid)
            b.status = "error"
            b.doc["reason"] = {"message": f"internal error: {type(e).__name__}: {e}"}
            self._log(ab, "error", b.doc["reason"]["message"])
        finally:
            for sid in list(ab.sandboxes):
                with contextlib.suppress(Exception):
                    await self.orch.kill(sid)
            ab.sandboxes.clear()
            b.doc["finished"] = time.time()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.orch.storage.release, "build", bid)
            with contextlib.suppress(Exception):
                await self._flush(ab)
                await asyncio.to_thread(self.store.put, b)
            self._active.pop(bid, None)

    async def _build(self, ab: ActiveBuild, spec: BuildSpec) -> None:
        b = ab.record
        bid = b.build_id
        pin = holder("build", bid)
        state = BuildState()
        origin: dict[str, Any] = {}
        ab.step = "base"
        if spec.from_image:
            self._log(ab, "info", f"[base] FROM {spec.from_image}")
            img = await self.images.pull(
                spec.from_image,
                registry=spec.registry,
                pin=pin,
                progress=self._pull_logger(ab),
            )
            layers = list(img.layers)
            cfg = img.config
            state.env = cfg.env_dict()
            state.workdir = cfg.workdir or None
            state.user = cfg.user or None
            origin = {"fromImage": spec.from_image, "image": img.reference, "digest": img.digest}
            self._log(ab, "info", f"[base] image {img.reference} ({len(layers)} layers)")
        else:
            assert spec.from_template is not None
            self._log(ab, "info", f"[base] FROM template {spec.from_template}")
            ftid, fdoc, _ = await asyncio.to_thread(self.orch.template, spec.from_template)
            if ftid == b.template_id:
                raise BuildFailed("a template cannot be built from itself", "base")
            layers = list(fdoc.get("layers") or [])
            await asyncio.to_thread(self.orch.storage.hold, "build", bid, layers)
            state.env = dict(fdoc.get("env") or {})
            state.workdir = fdoc.get("workdir") or None
            state.user = fdoc.get("user") or None
            origin = {"fromTemplate": ftid}
            if fdoc.get("checkpoint"):
                self._log(ab, "info", "[base] (its files only: running processes are not kept)")
        missing = [d for d in layers if not self.orch.storage.layers.has(d)]
        if missing:
            raise BuildFailed(f"base layers missing on this node: {', '.join(missing)}", "base")

        total = len(spec.steps)
        forced = spec.force
        # A workdir known to exist in `layers` (the image's WorkingDir may not: docker
        # creates it at run time, and so does the build before its first use).
        ensured = state.workdir if await self._has_dir(layers, state.workdir) else None
        for n, step in enumerate(spec.steps, 1):
            ab.step = str(n)
            label = f"[{n}/{total}] {step.describe()}"
            if step.type not in LAYER_STEPS:
                apply_state_step(state, step)
                self._log(ab, "info", label)
                continue
            forced = forced or step.force
            key = cache_key(layers, step, state)
            if not forced:
                top = await asyncio.to_thread(self._cached_layer, key, bid)
                if top is not None:
                    layers = [top, *layers]
                    ensured = state.workdir
                    self._log(ab, "info", f"{label} CACHED")
                    continue
            self._log(ab, "info", label)
            t0 = time.monotonic()
            layers = await self._layer_step(ab, n, step, layers, state)
            ensured = state.workdir
            await asyncio.to_thread(self.store.cache, key, layers[0])
            self._log(ab, "info", f"[{n}/{total}] done in {time.monotonic() - t0:.1f}s")
            await self._flush(ab)

        ab.step = "finalize"
        user, warning = stack.resolve_user(
            await asyncio.to_thread(self.images.passwd, layers), state.user
        )
        if warning:
            self._log(ab, "warn", f"[finalize] USER {state.user}: {warning}")
        doc: dict[str, Any] = {
            "kind": "template",
            "internal": False,
            "env": dict(state.env),
            "user": user,
            "workdir": state.workdir,
            "cpu_count": int(b.doc["cpu_count"]),
            "memory_mb": int(b.doc["memory_mb"]),
            "build_id": bid,
            "build_status": "ready",
            "start_cmd": spec.start_cmd,
            "ready_cmd": spec.ready_cmd,
            **({"metadata": spec.metadata} if spec.metadata else {}),
            **origin,
        }
        if spec.start_cmd or spec.ready_cmd:
            await self._snapshot_started(ab, spec, layers, state, user, doc)
            return
        if (
            state.workdir
            and ensured != state.workdir
            and not await self._has_dir(layers, state.workdir)
        ):
            fin = Step("WORKDIR", [state.workdir])
            key = cache_key(layers, fin, state)
            top = None if forced else await asyncio.to_thread(self._cached_layer, key, bid)
            if top is not None:
                layers = [top, *layers]
            else:
                self._log(ab, "info", f"[finalize] creating WORKDIR {state.workdir}")
                layers = await self._layer_step(ab, None, fin, layers, state)
                await asyncio.to_thread(self.store.cache, key, layers[0])
        doc.update(layers=layers, created_at=utcnow().isoformat())
        await self._register(b, doc)
        self._log(
            ab, "info", f"[finalize] template {b.template_id} registered ({len(layers)} layers)"
        )

    async def _has_dir(self, layers: list[str], path: str | None) -> bool:
        if not path:
            return False
        paths = [self.orch.storage.layers.path(d) for d in layers]
        return await asyncio.to_thread(stack.exists, paths, path)

    def _cached_layer(self, key: str, bid: str) -> str | None:
        top = self.store.cached(key)
        if top is None:
            return None
        # Reference first, then check: a layer present now stays (cache.py's race rule).
        self.orch.storage.hold("build", bid, [top])
        if self.orch.storage.layers.has(top):
            return top
        self.store.uncache(key)
        return None

    def _pull_logger(self, ab: ActiveBuild) -> Any:
        def report(p: LayerProgress) -> None:
            if p.status == "done":
                self._log(
                    ab, "info", f"[base] pulled layer {p.digest[:19]} ({p.total / 1e6:.1f} MB)"
                )
            elif p.status == "present" and p.done == p.total:
                self._log(ab, "debug", f"[base] layer {p.digest[:19]} already present")

        return report

    # ------------------------------------------------------------------ sandboxes
    async def _boot(
        self, ab: ActiveBuild, layers: list[str], state: BuildState, user: str | None
    ) -> tuple[SandboxRecord, EnvdRpc]:
        b = ab.record
        doc = {
            "kind": "build-step",
            "internal": True,
            "layers": list(layers),
            "env": dict(state.env),
            "user": user,
            "workdir": state.workdir,
            "created_at": utcnow().isoformat(),
        }
        tid = f"bld-{uuid.uuid4().hex[:16]}"
        req = CreateRequest(
            timeout=min(BUILD_SANDBOX_TTL, self.settings.max_timeout),
            metadata={META_BUILD: b.build_id, "aenv.template": b.template_id},
            cpu_count=int(b.doc["cpu_count"]),
            memory_mb=int(b.doc["memory_mb"]),
            secure=True,
        )
        rec = await self.images.boot(tid, doc, req)
        ab.sandboxes.add(rec.sandbox_id)
        assert rec.address is not None
        return rec, self.orch.envd.rpc(rec.address, ENVD_PORT, rec.envd_access_token)

    async def _commit(self, ab: ActiveBuild, rec: SandboxRecord) -> list[str]:
        layers = await self.orch.export_layers(rec.sandbox_id)
        ab.sandboxes.discard(rec.sandbox_id)
        await asyncio.to_thread(self.orch.storage.hold, "build", ab.record.build_id, [layers[0]])
        return layers

    def _output(self, ab: ActiveBuild, prefix: str = "") -> Any:
        def emit(stream: str, line: str) -> None:
            self._log(ab, "info", prefix + line)

        return emit

    async def _layer_step(
        self, ab: ActiveBuild, n: int | None, step: Step, layers: list[str], state: BuildState
    ) -> list[str]:
        what = f"step {n} {step.describe()}" if n is not None else f"finalize {step.describe()}"
        entries = await asyncio.to_thread(self.images.passwd, layers)
        want = (
            step.args[1]
            if step.type == "RUN" and len(step.args) > 1 and step.args[1]
            else state.user
        )
        user, warning = stack.resolve_user(entries, want)
        if warning:
            self._log(ab, "warn", f"{what}: {warning}")
        user = user or stack.default_user(entries)
        rec, rpc = await self._boot(ab, layers, state, user)
        if state.workdir:
            await rpc.make_dir(state.workdir, user=user)
        if step.type == "RUN":
            end = await steps.run_shell(
                rpc,
                step.args[0],
                user=user,
                env=state.env,
                cwd=state.workdir,
                timeout=STEP_TIMEOUT,
                on_line=self._output(ab),
            )
            if end.exit_code != 0:
                raise BuildFailed(f"{what} failed: {end.status or end.error}", str(n))
        elif step.type == "COPY":
            src, dest, owner, mode = step.args
            bundle = self.orch._bundle
            end = await steps.copy_files(
                rpc,
                self.files.path(str(step.files_hash)),
                str(step.files_hash),
                python=bundle.python_args(),
                python_env=bundle.python_env(),
                src=src,
                dest=dest,
                owner=owner or user,
                mode=mode,
                workdir=state.workdir,
                on_line=self._output(ab),
            )
            if end.exit_code != 0:
                raise BuildFailed(f"{what} failed: {end.status or end.error}", str(n))
        return await self._commit(ab, rec)

    async def _snapshot_started(
        self,
        ab: ActiveBuild,
        spec: BuildSpec,
        layers: list[str],
        state: BuildState,
        user: str | None,
        doc: dict[str, Any],
    ) -> None:
        b = ab.record
        entries = await asyncio.to_thread(self.images.passwd, layers)
        run_as = user or stack.default_user(entries)
        rec, rpc = await self._boot(ab, layers, state, user)
        if state.workdir:
            await rpc.make_dir(state.workdir, user=run_as)
        bg = steps.Background()
        if spec.start_cmd:
            self._log(ab, "info", f'[finalize] start command "{spec.start_cmd}"')
            bg.start(
                rpc,
                spec.start_cmd,
                user=run_as,
                env=state.env,
                cwd=state.workdir,
                on_line=self._output(ab, "[start] "),
            )
            await bg.started.wait()
            if bg.error:
                raise BuildFailed(f"finalize: the start command failed: {bg.error}", "finalize")
        try:
            await self._wait_ready(ab, spec, rpc, bg, run_as, state)
        finally:
            await bg.detach()
        await asyncio.sleep(0.2)  # let envd see the stream go before the checkpoint
        extra = {k: v for k, v in doc.items() if k not in ("env", "user", "workdir")}
        extra.update(parent=origin_of(doc), names=b.names)
        self._log(ab, "info", "[finalize] snapshotting the running sandbox (memory and files)")
        tid, _ = await self.orch.snapshot(
            rec.sandbox_id, None, template_id=b.template_id, extra=extra
        )
        found = await asyncio.to_thread(self.orch.catalog.template, tid)
        assert found is not None
        await self._register(b, found[1], snapshot=True)
        self._log(ab, "info", f"[finalize] template {tid} registered (snapshot with memory)")

    async def _wait_ready(
        self,
        ab: ActiveBuild,
        spec: BuildSpec,
        rpc: EnvdRpc,
        bg: steps.Background,
        user: str,
        state: BuildState,
    ) -> None:
        deadline = time.monotonic() + self.ready_timeout
        delay = 0.5
        attempt = 0
        while True:
            if bg.end is not None and bg.end.exit_code != 0:
                raise BuildFailed(
                    f'finalize: the start command "{spec.start_cmd}" exited before ready: '
                    f"{bg.end.status}",
                    "finalize",
                )
            if not spec.ready_cmd:
                await asyncio.sleep(2.0)
                if bg.end is not None and bg.end.exit_code != 0:
                    continue  # reported above
                self._log(ab, "info", "[finalize] no ready command: ready after 2s")
                return
            attempt += 1
            end = await steps.run_shell(
                rpc,
                spec.ready_cmd,
                user=user,
                env=state.env,
                cwd=state.workdir,
                timeout=READY_CHECK_TIMEOUT,
                on_line=lambda _s, line: self._log(ab, "debug", f"[ready] {line}"),
            )
            if end.exit_code == 0:
                self._log(ab, "info", f'[finalize] ready: "{spec.ready_cmd}" succeeded')
                return
            if time.monotonic() >= deadline:
                raise BuildFailed(
                    f'finalize: the ready command "{spec.ready_cmd}" did not succeed within '
                    f"{self.ready_timeout:.0f}s (last: {end.status or end.error})",
                    "finalize",
                )
            if attempt == 1 or attempt % 10 == 0:
                self._log(ab, "info", f"[finalize] waiting for ready ({end.status or end.error})")
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 2.0)

    async def _register(
        self, b: BuildRecord, doc: dict[str, Any], *, snapshot: bool = False
    ) -> None:
        """Makes `doc` the template's doc under its names, replacing an earlier build: the
        old layer references go (the build pin holds the new stack meanwhile), an old
        memory image that the new doc does not use is removed."""
        tid = b.template_id
        old = await asyncio.to_thread(self.orch.catalog.template, tid)
        await asyncio.to_thread(self.orch.storage.release, "template", tid)
        if snapshot:
            # `orchestrator.snapshot` registered (and published) the doc already; add the
            # names and take the references again.
            await asyncio.to_thread(self.orch.storage.hold, "template", tid, list(doc["layers"]))
            await asyncio.to_thread(self.orch.catalog.put_template, tid, doc, b.names)
        else:
            await self.orch.register_template(tid, doc, b.names)
        if (
            old is not None
            and old[1].get("checkpoint")
            and old[1]["checkpoint"] != doc.get("checkpoint")
        ):
            await asyncio.to_thread(self.orch.storage.remove_image, str(old[1]["checkpoint"]))


def origin_of(doc: dict[str, Any]) -> str | None:
    value = doc.get("fromTemplate") or doc.get("fromImage")
    return str(value) if value else None
