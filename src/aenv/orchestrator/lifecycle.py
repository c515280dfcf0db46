"""Pause (freeze → hibernate, or files only), resume, snapshots and fork.

Tiers of a paused sandbox (`record.paused_state["tier"]`):
    frozen      the container is paused in place: CPU released, memory kept; resume = thaw
    hibernated  memory + processes checkpointed to an image, container and slot released;
                resume = restore the image over the same layers and upper
    files       only the files are kept (E2B `memory: false`); resume = a fresh boot

A snapshot checkpoints the running sandbox, seals its upper into a read-only layer and
restores it on a fresh upper over the new stack (same id, address and processes). The
snapshot is then a template: its layer stack + the checkpoint image. Fork = a snapshot that
N children restore from, each on its own empty upper: no file data is copied.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import re
import secrets
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from ..errors import AenvError, BadRequest, Conflict, Gone, NotFound
from ..runtime.base import Instance
from .models import CreateRequest, SandboxRecord, State, utcnow
from .service import OrchestratorCore, Timings, check_timeout, new_id

log = logging.getLogger("aenv.orchestrator")

# Seconds a hibernated sandbox stays on the node's disk only before it is published.
PUBLISH_HIBERNATION_AFTER = 5.0


@dataclass
class ForkResult:
    sandbox: SandboxRecord | None = None
    error: AenvError | None = None


class Orchestrator(OrchestratorCore):
    # ------------------------------------------------------------------ timers
    async def _on_timeout(self, r: SandboxRecord) -> None:
        if r.auto_pause:
            log.info("sandbox %s timed out: pausing", r.sandbox_id)
            await self.pause(r.sandbox_id, memory=r.auto_pause_memory)
        else:
            await super()._on_timeout(r)

    async def _tick(self) -> None:
        await super()._tick()
        after = self.settings.hibernate_after
        now = utcnow()
        for r in list(self._records.values()):
            ps = r.paused_state or {}
            if r.state is not State.PAUSED or ps.get("tier") != "frozen":
                continue
            if (now - _parse(ps["paused_at"])).total_seconds() < after:
                continue
            try:
                await self.hibernate(r.sandbox_id)
            except Exception:
                log.exception("hibernating %s failed", r.sandbox_id)

    async def _on_shutdown(self) -> None:
        # Frozen sandboxes would die with the host's processes on a reboot: put them on disk.
        for r in list(self._records.values()):
            if r.state is State.PAUSED and (r.paused_state or {}).get("tier") == "frozen":
                try:
                    await self.hibernate(r.sandbox_id)
                except Exception:
                    log.exception("hibernating %s at shutdown failed", r.sandbox_id)

    # ------------------------------------------------------------------ boot snapshots
    async def _prepare_boot_snapshots(self) -> None:
        if self._boot_cleaned or not self.settings.boot_snapshots:
            return
        self._boot_cleaned = True
        # Earlier runs' boot snapshots are stale: the envd bundle or runsc may have changed.
        for old_id, old_doc, _ in await asyncio.to_thread(self.catalog.templates):
            if old_doc.get("boot_of") and old_doc.get("boot_run") != self._boot_run:
                await self.delete_template(old_id)
        found = await asyncio.to_thread(self.catalog.template, "base")
        if found is not None:
            doc = found[1]
            cpu = int(doc.get("cpu_count") or self.settings.default_cpu_count)
            mem = int(doc.get("memory_mb") or self.settings.default_memory_mb)
            await self._ensure_boot_snapshot(found[0], cpu, mem)

    async def _ensure_boot_snapshot(self, template_id: str, cpu: int, mem: int) -> None:
        key = (template_id, cpu)
        if key in self._boot_tried or self._closing:
            return
        if self._memory_in_use() + mem > self.memory_budget_mb // 2:
            return  # speculative: never with memory users may be about to ask for (later)
        self._boot_tried.add(key)
        try:
            # Speculative work: behind the boots already queued (a burst of creates of this
            # new shape would pay for it); the burst's followers get it.
            async with self._boot_slots:
                pass
            await self._make_boot_snapshot(template_id, cpu, mem)
        except Exception as e:
            log.warning("no boot snapshot of %s (%d CPU, %d MiB): %s", template_id, cpu, mem, e)

    async def _make_boot_snapshot(self, template_id: str, cpu: int, mem: int) -> None:
        """Boots one sandbox of the template, lets envd start and run one login shell, and
        snapshots it (an internal snapshot `boot_of` the template, for that CPU count): new
        sandboxes of that template and CPU count, whatever their memory size, restore it
        instead of paying envd's start-up in gVisor again. The sandbox itself is dropped.
        Made anew at each start of the node."""
        found = await asyncio.to_thread(self.catalog.template, template_id)
        if found is None or found[1].get("checkpoint"):
            return
        tid, doc, _names = found
        self._reserve(mem)
        t = Timings()
        r = await self._preboot(tid, doc, cpu, mem, alias=None, boot=None, timings=t)
        try:
            r.state = State.RUNNING
            async with self._lock(r.sandbox_id):
                snap_id, back = await self._snapshot_locked(
                    r,
                    t,
                    names=[],
                    internal=True,
                    restore_later=True,
                    extra={
                        "boot_of": tid,
                        "boot_from_layers": list(doc["layers"]),
                        "boot_run": self._boot_run,
                    },
                )
            if back is not None:
                back.close()  # the source is not wanted back
        finally:
            if r.instance:
                await self._destroy_quietly(Instance.from_json(r.instance))
            self._records.pop(r.sandbox_id, None)
            self._locks.pop(r.sandbox_id, None)
            await self.catalog.adelete_sandbox(r.sandbox_id)
            await self._forget(r)
        made = await asyncio.to_thread(self.catalog.template, snap_id)
        if made is not None:
            self._boot_snapshots[(tid, cpu)] = (snap_id, made[1])
            log.info("boot snapshot %s of %s (%d CPU, %d MiB) ready", snap_id, tid, cpu, mem)

    # ------------------------------------------------------------------ pause
    async def pause(
        self, sandbox_id: str, memory: bool = True, timings: Timings | None = None
    ) -> None:
        t = timings or Timings()
        self.get(sandbox_id)
        async with self._lock(sandbox_id):
            r = self.get(sandbox_id)
            if r.state is State.PAUSED:
                raise Conflict(f"sandbox {sandbox_id!r} is already paused")
            if r.state is not State.RUNNING or r.instance is None:
                raise Conflict(f"sandbox {sandbox_id!r} cannot be paused while {r.state}")
            inst = Instance.from_json(r.instance)
            if not memory:
                with t.stage("stop"):
                    await self.runtime.destroy(inst)
                r.instance = None
                r.paused_state = {"tier": "files", "paused_at": utcnow().isoformat()}
            else:
                with t.stage("freeze"):
                    await self.runtime.freeze(inst)
                r.paused_state = {"tier": "frozen", "paused_at": utcnow().isoformat()}
            r.state = State.PAUSED
            await self._save(r)
            if memory and self.settings.hibernate_after <= 0:
                await self._hibernate_locked(r, t)

    async def hibernate(self, sandbox_id: str, timings: Timings | None = None) -> None:
        t = timings or Timings()
        async with self._lock(sandbox_id):
            r = self._records.get(sandbox_id)
            if r is None or r.state is not State.PAUSED:
                return
            if (r.paused_state or {}).get("tier") != "frozen":
                return
            await self._hibernate_locked(r, t)

    async def _hibernate_locked(self, r: SandboxRecord, t: Timings) -> None:
        assert r.instance is not None
        inst = Instance.from_json(r.instance)
        # A new name each time: the previous image may still be being dropped after a resume.
        name = f"hib-{r.sandbox_id}-{secrets.token_hex(4)}"
        image = await asyncio.to_thread(self.storage.fresh_image_dir, name)
        with t.stage("checkpoint"):
            await self.runtime.checkpoint(inst, image, leave_running=False)
        with t.stage("release"):
            await self.runtime.destroy(inst)
        r.instance = None
        # Sealed, the files are plain layers: the repository can hold the whole sandbox.
        await self._restack(r, t, None, reuse=None)
        r.paused_state = {**(r.paused_state or {}), "tier": "hibernated", "image": name}
        await self._save(r)
        if self.durable is not None:
            self._spawn(self._publish_hibernation(r.sandbox_id, name))
        log.info("sandbox %s hibernated", r.sandbox_id)

    async def _publish_hibernation(self, sandbox_id: str, image: str) -> None:
        """Publishes a hibernated sandbox; once it is in the repository, the node keeps its
        memory image only in the bounded image cache."""
        assert self.durable is not None
        # Not at once: a sandbox resumed within seconds (the common case for an agent) is
        # never published, and the publish does not take CPU from that resume.
        await asyncio.sleep(PUBLISH_HIBERNATION_AFTER)
        async with self._lock(sandbox_id):
            r = self._records.get(sandbox_id)
            if r is None or (r.paused_state or {}).get("image") != image:
                return
            task = self.durable.publish_later(image, self._hibernation_doc(r, image), [])
        (ok,) = await asyncio.gather(task, return_exceptions=True)
        if ok is not True:
            return  # failed (logged) or cancelled by a resume/kill: the local copy stays
        async with self._lock(sandbox_id):
            still = self._records.get(sandbox_id)
            if still is not None and (still.paused_state or {}).get("image") == image:
                await self.durable.hand_over(image)

    def _hibernation_doc(self, r: SandboxRecord, image: str) -> dict[str, Any]:
        return {
            "kind": "hibernation",
            "layers": list(r.layers),
            "checkpoint": image,
            "sandbox_id": r.sandbox_id,
            "parent": r.template_id,
            "env": r.boot.get("env"),
            "user": r.boot.get("user"),
            "workdir": r.boot.get("workdir"),
            "cpu_count": r.cpu_count,
            "memory_mb": r.memory_mb,
            "created_at": utcnow().isoformat(),
        }

    @contextlib.asynccontextmanager
    async def _hibernation_image(
        self, r: SandboxRecord, t: Timings | None = None
    ) -> AsyncIterator[Path]:
        name = str((r.paused_state or {})["image"])
        if self.durable is not None:
            async with contextlib.AsyncExitStack() as stack:
                with (t or Timings()).stage("fetch"):  # the fetch only, not the use
                    path = await stack.enter_async_context(self.durable.local_image(name))
                yield path
            return
        image = self.storage.image_dir(name)
        if not (image / "checkpoint.img").exists():
            raise NotFound(f"the memory image of paused sandbox {r.sandbox_id!r} is missing")
        yield image

    # ------------------------------------------------------------------ resume
    async def _resume_locked(self, r: SandboxRecord, t: Timings) -> None:
        ps = r.paused_state or {}
        tier = ps.get("tier")
        if tier != "frozen":
            self._reserve(r.memory_mb)
        r.state = State.RESUMING
        try:
            if tier == "frozen":
                assert r.instance is not None
                with t.stage("thaw"):
                    await self.runtime.thaw(Instance.from_json(r.instance))
            elif tier == "hibernated":
                async with self._hibernation_image(r, t) as image:
                    await self._boot(r, t, image=image, init=False)
                self._spawn(self._drop_image(str(ps["image"])))
            else:  # files only: boot fresh on the kept upper
                await self._boot(r, t)
        except BaseException:
            r.state = State.PAUSED
            raise
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
        self.get(sandbox_id)
        async with self._lock(sandbox_id):
            r = self.get(sandbox_id)
            resumed = False
            check_timeout(timeout, self.settings)
            if r.state is State.PAUSED:
                if memory is False and (r.paused_state or {}).get("tier") != "files":
                    # E2B's on_resume="reboot": drop the memory, keep the files.
                    if r.instance:
                        await self.runtime.destroy(Instance.from_json(r.instance))
                        r.instance = None
                    r.paused_state = {"tier": "files", "paused_at": utcnow().isoformat()}
                await self._resume_locked(r, t)
                resumed = True
                ttl = self.settings.default_timeout if timeout is None else timeout
                r.end_at = utcnow() + timedelta(seconds=ttl)
            elif timeout is not None:
                r.end_at = max(r.end_at, utcnow() + timedelta(seconds=timeout))
            await self._save(r)
        return r, resumed

    async def resolve(self, sandbox_id: str, port: int) -> tuple[str, int]:
        r = self._records.get(sandbox_id)
        if r is None or r.state not in (State.RUNNING, State.PAUSED, State.RESUMING, State.PAUSING):
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        if r.state is not State.RUNNING:
            if not r.auto_resume:
                raise Gone(f"sandbox {sandbox_id!r} is paused")
            await self.connect(sandbox_id, max(300, self.settings.default_timeout))
        if r.address is None:
            raise NotFound(f"sandbox {sandbox_id!r} is not running")
        return r.address, port

    # ------------------------------------------------------------------ snapshots
    async def snapshot(
        self,
        sandbox_id: str,
        name: str | None = None,
        timings: Timings | None = None,
        *,
        template_id: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> tuple[str, builtins.list[str]]:
        """Makes a template of the sandbox's files, memory and processes; it keeps running."""
        t = timings or Timings()
        self.get(sandbox_id)
        if name is not None:
            _check_name(name)
            if await asyncio.to_thread(self.catalog.template, name) is not None:
                raise Conflict(f"a template or snapshot named {name!r} already exists")
        async with self._lock(sandbox_id):
            r = self.get(sandbox_id)
            snap_id, _ = await self._snapshot_locked(
                r, t, names=[name] if name else [], snap_id=template_id, extra=extra
            )
        return snap_id, [name] if name else []

    async def _snapshot_locked(
        self,
        r: SandboxRecord,
        t: Timings,
        *,
        names: builtins.list[str],
        internal: bool = False,
        snap_id: str | None = None,
        extra: dict[str, Any] | None = None,
        restore_later: bool = False,
    ) -> tuple[str, Coroutine[Any, Any, None] | None]:
        """Checkpoints the sandbox and registers the snapshot; the sandbox is back when this
        returns, or (`restore_later`) when the returned coroutine has run: the snapshot is
        usable before that, so fork children restore while the parent does."""
        snap_id = snap_id or new_id("s")
        back: Coroutine[Any, Any, None] | None = None
        image = await asyncio.to_thread(self.storage.fresh_image_dir, snap_id)
        tier = (r.paused_state or {}).get("tier") if r.state is State.PAUSED else None
        if r.state is State.RUNNING or tier == "frozen":
            assert r.instance is not None
            inst = Instance.from_json(r.instance)
            if tier == "frozen":
                with t.stage("thaw"):
                    await self.runtime.thaw(inst)
            with t.stage("checkpoint"):
                await self.runtime.checkpoint(inst, image, leave_running=False)
            with t.stage("stop"):
                await self.runtime.stop(inst)
            await self._restack(r, t, None, reuse=None)
            back = self._restore_in_place(r, t, image, inst, refreeze=tier == "frozen")
            if not restore_later:
                await back
                back = None
        elif tier == "hibernated":
            # Already on disk (hibernation sealed the files): the snapshot shares its image.
            async with self._hibernation_image(r) as src:
                await asyncio.to_thread(self.storage.link_image, src, snap_id)
        else:
            raise Conflict(f"sandbox {r.sandbox_id!r} cannot be snapshotted while {r.state}")
        doc: dict[str, Any] = {
            "kind": "snapshot",
            "internal": internal,
            "layers": list(r.layers),
            "checkpoint": snap_id,
            "sandbox_id": r.sandbox_id,
            "parent": r.template_id,
            "envd_token": r.envd_access_token,
            "env": r.boot.get("env"),
            "user": r.boot.get("user"),
            "workdir": r.boot.get("workdir"),
            "env_vars": dict(r.env_vars),
            "cpu_count": r.cpu_count,
            "memory_mb": r.memory_mb,
            "created_at": utcnow().isoformat(),
            **(extra or {}),
        }
        try:
            await self.register_template(snap_id, doc, names)
            await self._save(r)
        except BaseException:
            if back is not None:
                await back  # the sandbox comes back all the same
            raise
        return snap_id, back

    async def _restore_in_place(
        self, r: SandboxRecord, t: Timings, image: Path, stopped: Instance, *, refreeze: bool
    ) -> None:
        """Restores a checkpointed, re-stacked sandbox in its own network slot: same address
        for everyone."""
        try:
            await self._restack(r, t, image, reuse=stopped)
        except BaseException:
            await self._destroy_quietly(stopped)
            raise
        if refreeze:
            await self.runtime.freeze(Instance.from_json(r.instance or {}))

    async def _restack(
        self, r: SandboxRecord, t: Timings, image: Path | None, *, reuse: Instance | None
    ) -> None:
        """Seal the upper as a layer and (if `image`) restore the sandbox on a fresh one."""
        assert r.upper is not None
        with t.stage("seal"):
            # An untouched upper stays as it is: a layer of nothing would only lengthen the stack.
            if not await asyncio.to_thread(_is_empty, Path(r.upper)):
                digest = await asyncio.to_thread(self.storage.seal, Path(r.upper), r.sandbox_id)
                r.layers = [digest, *r.layers]
                await asyncio.to_thread(self.storage.hold, "sandbox", r.sandbox_id, [digest])
                r.upper = str(await asyncio.to_thread(self.storage.new_upper, r.sandbox_id))
                self._squash_later(r)
        if image is not None:
            try:
                await self._boot(r, t, image=image, reuse=reuse, init=False)
            except Exception as e:
                r.state = State.LOST
                r.note = f"restoring it after a snapshot failed: {e}"
                await self._save(r)
                raise

    async def export_layers(self, sandbox_id: str) -> builtins.list[str]:
        """Ends the sandbox and returns its files as a layer stack (topmost first): the
        upper is sealed into a new layer on top of the ones it ran on. Template builds
        commit each step this way."""
        self.get(sandbox_id)
        async with self._lock(sandbox_id):
            r = self.get(sandbox_id)
            if r.instance:
                await self.runtime.destroy(Instance.from_json(r.instance))
                r.instance = None
            assert r.upper is not None
            digest = await asyncio.to_thread(self.storage.seal, Path(r.upper), r.sandbox_id)
            layers = [digest, *r.layers]
            r.upper = None
        await self.kill(sandbox_id)
        return layers

    async def delete_template(self, template_id: str) -> None:
        found = await asyncio.to_thread(self.catalog.template, template_id)
        if found is None:
            raise NotFound(f"template {template_id!r} not found")
        tid, doc, _ = found
        if tid == "base":
            raise BadRequest("the default template 'base' cannot be deleted")
        for key, (boot_id, _boot_doc) in list(self._boot_snapshots.items()):
            if key[0] == tid:  # its boot snapshots go with it
                del self._boot_snapshots[key]
                await self.delete_template(boot_id)
        await asyncio.to_thread(self.catalog.delete_template, tid)
        await asyncio.to_thread(self.storage.release, "template", tid)
        if self.durable is not None and not doc.get("internal"):
            await self.durable.forget(tid)  # first: a publish in flight still reads the image
        if doc.get("checkpoint"):
            await asyncio.to_thread(self.storage.remove_image, str(doc["checkpoint"]))

    def snapshots(
        self, sandbox_id: str | None = None, name: str | None = None
    ) -> builtins.list[tuple[str, dict[str, Any], builtins.list[str]]]:
        out = []
        for tid, doc, names in self.catalog.templates():
            if doc.get("kind") != "snapshot" or doc.get("internal"):
                continue
            if sandbox_id and doc.get("sandbox_id") != sandbox_id:
                continue
            if name and name not in names:
                continue
            out.append((tid, doc, names))
        out.sort(key=lambda x: (str(x[1].get("created_at")), x[0]))
        return out

    # ------------------------------------------------------------------ fork
    async def fork(
        self,
        sandbox_id: str,
        count: int,
        timeout: int | None = None,
        timings: Timings | None = None,
    ) -> builtins.list[ForkResult]:
        t = timings or Timings()
        if not 1 <= count <= 20:
            raise BadRequest("count must be between 1 and 20")
        check_timeout(timeout, self.settings)
        self.get(sandbox_id)
        async with self._lock(sandbox_id):
            parent = self.get(sandbox_id)
            if parent.state is not State.RUNNING:
                raise Conflict(
                    f"sandbox {sandbox_id!r} must be running to fork (it is {parent.state})"
                )
            snap_id, parent_back = await self._snapshot_locked(
                parent, t, names=[], internal=True, restore_later=True
            )
            ttl = timeout
            if ttl is None:
                ttl = max(1, int((parent.end_at - utcnow()).total_seconds()))

            async def child() -> ForkResult:
                # Children queue for boot slots like any create (OrchestratorCore._boot).
                req = CreateRequest(
                    template_id=snap_id,
                    timeout=ttl,
                    metadata=dict(parent.metadata),
                    env_vars=dict(parent.env_vars),
                    auto_pause=parent.auto_pause,
                    auto_pause_memory=parent.auto_pause_memory,
                    auto_resume=parent.auto_resume,
                    secure=bool(parent.envd_access_token),
                )
                try:
                    c = await self.create(req)
                except AenvError as e:
                    return ForkResult(error=e)
                except Exception as e:
                    return ForkResult(error=AenvError(f"fork child failed: {e}"))
                c.template_id = parent.template_id
                c.alias = parent.alias
                c.parent_id = parent.sandbox_id
                await self._save(c)
                return ForkResult(sandbox=c)

            with t.stage("children"):
                # The children restore from the snapshot while the parent does (under its
                # lock); a parent that fails to come back is marked lost, its children stay.
                kids = asyncio.ensure_future(asyncio.gather(*(child() for _ in range(count))))
                if parent_back is not None:
                    try:
                        await parent_back
                    except Exception:
                        log.exception("fork of %s: the parent did not come back", sandbox_id)
        with t.stage("children"):
            results = await kids
        # Children no longer need the image; their layers stay (they run on them).
        await self.delete_template(snap_id)
        return list(results)


def _is_empty(d: Path) -> bool:
    with os.scandir(d) as it:
        return next(it, None) is None


def _parse(ts: str) -> datetime:
    return datetime.fromisoformat(ts)


def _check_name(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}", name):
        raise BadRequest(
            f"invalid snapshot name {name!r}: use letters, digits and _.:/- (max 128 chars)"
        )
