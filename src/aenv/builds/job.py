"""One template build from its base to its final layer stack; finalize.py makes the template.

  base   pull `fromImage` (credentials from `fromImageRegistry`) or take the layers of
         `fromTemplate` (also of a template the image-alias table maps `fromImage` to,
         aliases.py); the image config seeds ENV, WORKDIR and USER
  steps  ENV / WORKDIR / USER change the build state. RUN and COPY each boot a build
         sandbox on the current layer stack (as the build USER, in WORKDIR, with ENV), do
         their work, and commit: `export_layers` seals the sandbox's upper as a new layer on
         top. Per-step cache: key = hash(parent layers, step, files hash, build state) ->
         that layer; a hit skips the step (unless `force`, skip_cache, or the layer was
         evicted)
Every layer the build stands on is held under ("build", build id) until the build ends."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import Settings
from ..domain import (
    BuildInfo,
    CreateRequest,
    SandboxRecord,
    TemplateKind,
    TemplateRecord,
    utcnow,
)
from ..envd_client import EnvdClient
from ..images.pull import LayerProgress
from ..orchestrator import Orchestrator
from . import stack, steps
from .aliases import alias_for
from .files import BuildFiles
from .images import Images
from .spec import LAYER_STEPS, BuildSpec, BuildState, Step, apply_state_step, cache_key
from .store import BuildRecord, BuildStore, LogEntry
from .tags import Tags

BUILD_SANDBOX_TTL = 6 * 3600
STEP_TIMEOUT = 3600.0
# Sandbox metadata naming the build a sandbox belongs to.
META_BUILD = "aenv.build"
# Who holds a build's layers.
BUILD_PIN = "build"


class BuildFailed(Exception):
    def __init__(self, message: str, step: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.step = step


@dataclass
class ActiveBuild:
    """A build between its start and its end: its record (with the spec it runs), logs (kept
    in memory, flushed to the store as it goes) and the build sandboxes alive right now."""

    record: BuildRecord
    logs: list[LogEntry] = field(default_factory=list)
    flushed: int = 0
    task: asyncio.Task[None] | None = None
    sandboxes: set[str] = field(default_factory=set)
    step: str | None = None

    def log(self, level: str, message: str, step: str | None = None) -> None:
        self.logs.append(LogEntry(len(self.logs), time.time(), level, message, step or self.step))

    def output(self, prefix: str = "") -> Callable[[str, str], None]:
        """A step's output lines as log entries."""

        def emit(_stream: str, line: str) -> None:
            self.log("info", prefix + line)

        return emit


@dataclass
class Stack:
    """Where the steps left the build: its layers (topmost first) and build state."""

    layers: list[str]
    state: BuildState
    # How the base was given, kept on the template (fromImage/image/digest or fromTemplate).
    # Where the build started from (the rest of its BuildInfo is filled in at the end).
    origin: BuildInfo
    # A step ran uncached since the first forced one (so finalize's WORKDIR step is too).
    forced: bool = False
    # A workdir known to exist in `layers` (the image's WorkingDir may not: docker creates
    # it at run time, and so does the build before its first use).
    ensured: str | None = None


class BuildJob:
    def __init__(
        self,
        settings: Settings,
        orch: Orchestrator,
        images: Images,
        store: BuildStore,
        files: BuildFiles,
        ab: ActiveBuild,
        tags: Tags,
    ) -> None:
        self.settings = settings
        self.orch = orch
        self.images = images
        self.store = store
        self.files = files
        self.ab = ab
        self.tags = tags
        self.build_id = ab.record.build_id

    async def flush_logs(self) -> None:
        new = self.ab.logs[self.ab.flushed :]
        if new:
            await asyncio.to_thread(self.store.add_logs, self.build_id, new)
            self.ab.flushed += len(new)

    # ------------------------------------------------------------------ base and steps
    async def layers(self, spec: BuildSpec) -> Stack:
        """Runs the base and every step: the stack the template is made of."""
        at = await self._base(spec)
        at.forced = spec.force
        total = len(spec.steps)
        at.ensured = at.state.workdir if await self.has_dir(at.layers, at.state.workdir) else None
        for n, step in enumerate(spec.steps, 1):
            self.ab.step = str(n)
            label = f"[{n}/{total}] {step.describe()}"
            if step.type not in LAYER_STEPS:
                apply_state_step(at.state, step)
                self.ab.log("info", label)
                continue
            at.forced = at.forced or step.force
            key = cache_key(at.layers, step, at.state)
            if not at.forced:
                top = await self.cached_layer(key)
                if top is not None:
                    at.layers = [top, *at.layers]
                    at.ensured = at.state.workdir
                    self.ab.log("info", f"{label} CACHED")
                    continue
            self.ab.log("info", label)
            t0 = time.monotonic()
            at.layers = await self.layer_step(n, step, at.layers, at.state)
            at.ensured = at.state.workdir
            await asyncio.to_thread(self.store.cache, key, at.layers[0])
            self.ab.log("info", f"[{n}/{total}] done in {time.monotonic() - t0:.1f}s")
            await self.flush_logs()
        return at

    async def _base(self, spec: BuildSpec) -> Stack:
        ab = self.ab
        ab.step = "base"
        state = BuildState()
        aliased = await self._aliased_template(spec.from_image)
        if aliased is not None:
            ab.log("info", f"[base] FROM {spec.from_image}: local template {aliased} (image alias)")
        if spec.from_image and aliased is None:
            ab.log("info", f"[base] FROM {spec.from_image}")
            img = await self.images.pull(
                spec.from_image,
                registry=spec.registry,
                pin=(BUILD_PIN, self.build_id),
                progress=self._pull_logger(),
            )
            layers = list(img.layers)
            state.env = img.config.env_dict()
            state.workdir = img.config.workdir or None
            state.user = img.config.user or None
            origin = BuildInfo(
                from_image=spec.from_image, image=img.reference, image_digest=img.digest
            )
            ab.log("info", f"[base] image {img.reference} ({len(layers)} layers)")
        else:
            source = aliased or spec.from_template
            assert source is not None
            if aliased is None:
                ab.log("info", f"[base] FROM template {source}")
            base = await self.orch.templates.get(source)
            if base.template_id == ab.record.template_id:
                raise BuildFailed("a template cannot be built from itself", "base")
            layers = list(base.layers)
            await asyncio.to_thread(self.orch.storage.hold, BUILD_PIN, self.build_id, layers)
            state.env = dict(base.env)
            state.workdir = base.workdir or None
            state.user = base.user or None
            origin = BuildInfo(
                from_template=base.template_id,
                from_image=None if aliased is None else spec.from_image,
            )
            if base.has_memory:
                ab.log("info", "[base] (its files only: running processes are not kept)")
        missing = [d for d in layers if not self.orch.storage.layers.has(d)]
        if missing:
            raise BuildFailed(f"base layers missing on this node: {', '.join(missing)}", "base")
        return Stack(layers=layers, state=state, origin=origin)

    async def _aliased_template(self, image: str | None) -> str | None:
        """The local template the image alias table maps `image` to, if that template exists."""
        if not image:
            return None
        name = alias_for(image, self.settings.images.image_aliases)
        if name is None:
            return None
        found = await self.orch.templates.find(name)
        if found is None or found.internal:
            return None
        return found.template_id

    async def has_dir(self, layers: list[str], path: str | None) -> bool:
        if not path:
            return False
        paths = [self.orch.storage.layers.path(d) for d in layers]
        return await asyncio.to_thread(stack.exists, paths, path)

    async def cached_layer(self, key: str) -> str | None:
        top = await asyncio.to_thread(self.store.cached, key)
        if top is None:
            return None
        # Reference first, then check: a layer present now stays (cache.py's race rule).
        await asyncio.to_thread(self.orch.storage.hold, BUILD_PIN, self.build_id, [top])
        if self.orch.storage.layers.has(top):
            return top
        await asyncio.to_thread(self.store.uncache, key)
        return None

    def _pull_logger(self) -> Callable[[LayerProgress], None]:
        def report(p: LayerProgress) -> None:
            if p.status == "done":
                self.ab.log("info", f"[base] pulled layer {p.digest[:19]} ({p.total / 1e6:.1f} MB)")
            elif p.status == "present" and p.done == p.total:
                self.ab.log("debug", f"[base] layer {p.digest[:19]} already present")

        return report

    # ------------------------------------------------------------------ build sandboxes
    async def boot(
        self, layers: list[str], state: BuildState, user: str | None
    ) -> tuple[SandboxRecord, EnvdClient]:
        """A build sandbox on `layers`, killed when the build ends if not committed."""
        b = self.ab.record
        step_stack = TemplateRecord(
            template_id=f"bld-{uuid.uuid4().hex[:16]}",
            kind=TemplateKind.BUILD_STEP,
            layers=list(layers),
            internal=True,
            env=dict(state.env),
            user=user,
            workdir=state.workdir,
            created_at=utcnow().isoformat(),
        )
        req = CreateRequest(
            timeout=min(BUILD_SANDBOX_TTL, self.settings.max_timeout),
            metadata={META_BUILD: b.build_id, "aenv.template": b.template_id},
            cpu_count=b.cpu_count,
            memory_mb=b.memory_mb,
        )
        rec = await self.images.boot(step_stack, req)
        self.ab.sandboxes.add(rec.sandbox_id)
        return rec, self.orch.envd(rec)

    async def commit(self, rec: SandboxRecord) -> list[str]:
        """Seals the sandbox's files as a new top layer (the sandbox is gone after)."""
        layers = await self.orch.sandboxes.export_layers(rec.sandbox_id)
        self.ab.sandboxes.discard(rec.sandbox_id)
        await asyncio.to_thread(self.orch.storage.hold, BUILD_PIN, self.build_id, [layers[0]])
        return layers

    async def layer_step(
        self, n: int | None, step: Step, layers: list[str], state: BuildState
    ) -> list[str]:
        """Runs a RUN or COPY step on `layers`: the stack with its new layer on top."""
        what = f"step {n} {step.describe()}" if n is not None else f"finalize {step.describe()}"
        entries = await asyncio.to_thread(self.images.passwd, layers)
        own = step.args[1] if step.type == "RUN" and len(step.args) > 1 else None
        if own and (error := stack.run_user_error(entries, step.args[0], own)):
            raise BuildFailed(f"{what} failed: {error}", str(n))
        want = own or state.user
        user, warning = stack.resolve_user(entries, want)
        if warning:
            self.ab.log("warn", f"{what}: {warning}")
        user = user or stack.default_user(entries)
        rec, rpc = await self.boot(layers, state, user)
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
                on_line=self.ab.output(),
            )
            if end.exit_code != 0:
                raise BuildFailed(f"{what} failed: {end.status or end.error}", str(n))
        elif step.type == "COPY":
            src, dest, owner, mode = step.args
            python, python_env = self.orch.bundle.python_args(), self.orch.bundle.python_env()
            end = await steps.copy_files(
                rpc,
                self.files.path(str(step.files_hash)),
                str(step.files_hash),
                python=python,
                python_env=python_env,
                src=src,
                dest=dest,
                owner=owner or user,
                mode=mode,
                workdir=state.workdir,
                on_line=self.ab.output(),
            )
            if end.exit_code != 0:
                raise BuildFailed(f"{what} failed: {end.status or end.error}", str(n))
        return await self.commit(rec)
