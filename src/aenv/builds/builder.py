"""Template builds as E2B runs them (protocol §2.3): the requests, their records and logs,
and one background task per build (at most `concurrency` at once; the others wait).

`request()` (POST /v3/templates) makes a build record in `waiting`; `start_build()`
(POST /v2/templates/{id}/builds/{bid}) validates the steps and runs the build in a task
(job.py: base and steps, finalize.py: the template); the status route reads `status()` with
`logsOffset`. Failures end in `error` with `reason.message` naming the step; build
sandboxes are killed whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from typing import Any

from ..config import Settings
from ..domain import DEFAULT_TEMPLATE, TemplateKind, new_id
from ..errors import AenvError, BadRequest, Conflict, NotFound
from ..orchestrator import Orchestrator
from . import tag_history
from .autobuild import CodeInterpreterAutobuild
from .files import BuildFiles
from .finalize import READY_TIMEOUT, finalize
from .images import Images
from .job import BUILD_PIN, META_BUILD, ActiveBuild, BuildFailed, BuildJob
from .spec import parse_spec
from .store import LEVELS, BuildReason, BuildRecord, BuildStore, LogEntry
from .tag_history import AssignmentEvent
from .tags import DEFAULT_TAG, Tags, check_tags, owner_of, split_name

log = logging.getLogger("aenv.builds")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")


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
        self.images = images or Images(settings, orchestrator)
        self.store = BuildStore(settings.home / "builds.db")
        self.files = BuildFiles(settings.home / "build-files", settings.upload_secret)
        self.tags = Tags(self.store, orchestrator)
        self.ready_timeout = ready_timeout
        self._active: dict[str, ActiveBuild] = {}
        self._sem = asyncio.Semaphore(max(1, concurrency))
        self.autobuild = CodeInterpreterAutobuild(settings)

    # ------------------------------------------------------------------ node lifecycle
    async def start(self) -> None:
        try:
            await self._cleanup()
        except Exception:
            log.exception("cleaning up after the builds of an earlier server process failed")
        self.autobuild.start()

    async def _cleanup(self) -> None:
        """Ends what a previous server process left: unfinished builds, their sandboxes,
        transient internal templates and a build's snapshot not yet made its template."""
        for b in await asyncio.to_thread(self.store.unfinished):
            b.status = "error"
            b.reason = BuildReason("the build was interrupted by a server restart")
            b.finished = time.time()
            await asyncio.to_thread(self.store.put, b)
        for r in self.orch.table.list():
            if r.metadata.get(META_BUILD):
                with contextlib.suppress(AenvError):
                    await self.orch.sandboxes.kill(r.sandbox_id)
        transient = (TemplateKind.BUILD_STEP, TemplateKind.IMAGE)
        for t in await self.orch.templates.all():
            half_made = t.kind is TemplateKind.SNAPSHOT and t.build.build_id is not None
            if t.internal and (t.kind in transient or half_made):
                await self.images.unregister(t.template_id)

    async def close(self) -> None:
        await self.autobuild.close()
        tasks = [ab.task for ab in self._active.values() if ab.task and not ab.task.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.store.close()

    # ------------------------------------------------------------------ requests
    async def _template_for_name(self, name: str) -> str | None:
        """The id of the template `name` belongs to (catalog, or a build in flight)."""
        found = await self.orch.templates.find(name)
        if found is not None:
            tid = owner_of(found)
            if found.internal:
                return None
            if tid == DEFAULT_TEMPLATE or found.kind is TemplateKind.SNAPSHOT:
                what = "the default template" if tid == DEFAULT_TEMPLATE else "a snapshot"
                raise Conflict(f"{name!r} is the name of {what}; pick another template name")
            return tid
        for b in await asyncio.to_thread(self.store.all):
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
        if all_tags:
            all_tags = check_tags(all_tags)
        tid = await self._template_for_name(base)
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
            name=base,
            names=names,
            tags=all_tags,
            cpu_count=cpu_count or self.settings.default_cpu_count,
            memory_mb=memory_mb or self.settings.default_memory_mb,
        )
        await asyncio.to_thread(self.store.put, record)
        return record

    # ------------------------------------------------------------------ tags
    async def template_of(self, id_or_name: str) -> str:
        """The id of the template `id_or_name` (`name`, `name:tag`, an id) belongs to."""
        found = await self.orch.templates.find(id_or_name)
        if found is not None and not found.internal:
            return owner_of(found)
        base, _tag = split_name(id_or_name)
        for b in await asyncio.to_thread(self.store.all):
            if id_or_name in (b.template_id, *b.names) or base == b.name:
                return b.template_id
        if base != id_or_name:
            found = await self.orch.templates.find(base)
            if found is not None and not found.internal:
                return owner_of(found)
        raise NotFound(f"template {id_or_name!r} not found")

    async def get_tags(self, id_or_name: str) -> list[tuple[str, str, float]]:
        """(tag, build id, assigned at) of a template; a started build holds its tags
        from its start, as in E2B (creating from it answers 404 until it is ready)."""
        tid = await self.template_of(id_or_name)
        out = {r.tag: (r.build_id, r.created) for r in await self.tags.rows(tid)}
        started = sorted(
            (ab.record for ab in self._active.values() if ab.record.template_id == tid),
            key=lambda b: b.created,
        )
        for b in started:
            for t in b.tags or [DEFAULT_TAG]:
                out[t] = (b.build_id, b.created)
        return [(t, bid, at) for t, (bid, at) in out.items()]

    async def tag_events(self, id_or_name: str) -> list[AssignmentEvent]:
        """The ready assignments of a template's tags, newest first (tag_history.py)."""
        tid = await self.template_of(id_or_name)
        rows = await self.tags.rows(tid)
        recorded = await asyncio.to_thread(self.store.assignments, tid)
        builds = await asyncio.to_thread(self.store.for_template, tid)
        return tag_history.events(tid, rows, recorded, builds, await self.tags.records(tid))

    async def assign_tags(self, target: str, tags: list[str]) -> tuple[str, list[str]]:
        """`target` is `name:tag` (or `name`, its default build); returns (build id, tags)."""
        tags = check_tags(tags)
        base, tag = split_name(target)
        if not base or target.endswith(":"):
            raise BadRequest(f"invalid target {target!r}: use name:tag")
        tid = await self.template_of(base)
        bid = await self.tags.assign(tid, tag, tags)
        return bid, tags

    async def remove_tags(self, name: str, tags: list[str]) -> None:
        tags = check_tags(tags)
        tid = await self.template_of(split_name(name)[0])
        await self.tags.remove(tid, tags)

    # ------------------------------------------------------------------ builds
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
        b.spec = spec
        ab = ActiveBuild(record=b)
        self._active[build_id] = ab
        await asyncio.to_thread(self.store.put, b)
        ab.log("info", f"build {build_id} of template {b.template_id} queued")
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
        await self.tags.forget(template_id)
        await asyncio.to_thread(self.store.delete_template, template_id)
        return bool(b_all)

    # ------------------------------------------------------------------ the build
    async def _run(self, ab: ActiveBuild) -> None:
        b = ab.record
        bid = b.build_id
        job = BuildJob(self.settings, self.orch, self.images, self.store, self.files, ab, self.tags)
        t0 = time.monotonic()
        try:
            async with self._sem:
                b.status = "building"
                await asyncio.to_thread(self.store.put, b)
                spec = b.spec
                assert spec is not None
                at = await job.layers(spec)
                await finalize(job, spec, at, self.ready_timeout)
            b.status = "ready"
            ab.log("info", f"build finished in {time.monotonic() - t0:.1f}s", "finalize")
        except BuildFailed as e:
            b.status = "error"
            b.reason = BuildReason(e.message, e.step or None)
            ab.log("error", e.message, e.step)
        except asyncio.CancelledError:
            b.status = "error"
            b.reason = BuildReason("the build was cancelled")
            ab.log("error", "the build was cancelled")
        except AenvError as e:
            b.status = "error"
            msg = f"step {ab.step} failed: {e.message}" if ab.step else e.message
            b.reason = BuildReason(msg, ab.step or None)
            ab.log("error", msg)
        except Exception as e:
            log.exception("build %s failed", bid)
            b.status = "error"
            b.reason = BuildReason(f"internal error: {type(e).__name__}: {e}")
            ab.log("error", b.reason.message)
        finally:
            for sid in list(ab.sandboxes):
                with contextlib.suppress(Exception):
                    await self.orch.sandboxes.kill(sid)
            ab.sandboxes.clear()
            b.finished = time.time()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.orch.storage.release, BUILD_PIN, bid)
            with contextlib.suppress(Exception):
                await job.flush_logs()
                await asyncio.to_thread(self.store.put, b)
            self._active.pop(bid, None)
