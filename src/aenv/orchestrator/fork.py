"""Fork: one sandbox into N children with its memory, processes and files. A snapshot that
the children restore from, each on its own empty upper (no file data is copied), while the
parent is restored in place; the snapshot is deleted afterwards.

A paused parent (E2B answers 409 there) can be forked too and stays paused: a frozen one is
checkpointed and frozen again, a hibernated one lends its memory image as it is, and the
children of a files-only one boot fresh on a copy of its files (it has no memory to give).
The children run."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

from .. import crashpoint
from ..domain import (
    CreateRequest,
    PauseTier,
    SandboxRecord,
    SandboxState,
    TemplateKind,
    TemplateRecord,
    Timings,
)
from ..errors import AenvError, BadRequest, Conflict, NotFound
from . import eventrecords as ev
from .context import NodeContext, check_timeout
from .events import Events
from .lineage import fork_lineage
from .logs import SandboxLogs
from .nodeinfo import NodeStats
from .sandboxes import Sandboxes
from .snapshots import Snapshotter
from .table import SandboxTable
from .templates import TemplateRegistry

log = logging.getLogger("aenv.orchestrator")

MAX_CHILDREN = 20


@dataclass
class ForkResult:
    sandbox: SandboxRecord | None = None
    error: AenvError | None = None


@dataclass
class Forker:
    ctx: NodeContext
    table: SandboxTable
    snapshotter: Snapshotter
    sandboxes: Sandboxes
    templates: TemplateRegistry
    stats: NodeStats
    logs: SandboxLogs
    events: Events

    async def fork(
        self,
        sandbox_id: str,
        count: int,
        timeout: int | None = None,
        timings: Timings | None = None,
    ) -> list[ForkResult]:
        """`count` children of the sandbox, counted and logged as a fork; each child is
        counted and logged as a create too (`Sandboxes.create`), and refused like one on a
        draining node."""
        await self.ctx.wake(sandbox_id)
        with self.stats.observe("fork", sandbox_id):
            children = await self._fork(sandbox_id, count, timeout, timings or Timings())
        self.logs.note(sandbox_id, "sandbox forked", count=count)
        parent = self.table.find(sandbox_id)
        if parent is not None:
            self.events.record(
                ev.FORKED,
                parent,
                count=count,
                children=[c.sandbox.sandbox_id for c in children if c.sandbox is not None],
            )
        return children

    async def _fork(
        self, sandbox_id: str, count: int, timeout: int | None, t: Timings
    ) -> list[ForkResult]:
        if not 1 <= count <= MAX_CHILDREN:
            raise BadRequest(f"count must be between 1 and {MAX_CHILDREN}")
        check_timeout(timeout, self.ctx.settings)
        self.table.get(sandbox_id)
        self.ctx.check_taking()  # before the parent is touched, as below
        # All children or none: refused before the parent is touched when they would not
        # fit the boot queue; once admitted they queue like any create.
        self.sandboxes.booter.check_queue(count)
        first = self.table.get(sandbox_id)
        self.table.check_quota(first.owner, first.memory_mb, count)
        async with self.table.lock(sandbox_id):
            parent = self.table.get(sandbox_id)
            paused = parent.state is SandboxState.PAUSED
            if not paused and parent.state is not SandboxState.RUNNING:
                raise Conflict(
                    f"sandbox {sandbox_id!r} must be running or paused to fork "
                    f"(it is {parent.state})"
                )
            parent_back = None
            if parent.tier is PauseTier.FILES:
                snap = await self.snapshotter.take_files(
                    parent, t, names=[], internal=True, fork_of=sandbox_id
                )
            else:
                snap, parent_back = await self.snapshotter.take(
                    parent,
                    t,
                    names=[],
                    internal=True,
                    restore_later=True,
                    op="fork",
                    fork_of=sandbox_id,
                )
            crashpoint.hit("fork.snapshotted")
            ttl = timeout
            if ttl is None and paused:
                # A paused sandbox's deadline means nothing until it is resumed.
                ttl = self.ctx.settings.default_timeout
            elif ttl is None:
                ttl = max(1, int((parent.end_at - self.ctx.now()).total_seconds()))
            req = CreateRequest(
                template_id=snap.template_id,
                timeout=ttl,
                metadata=dict(parent.metadata),
                env_vars=dict(parent.env_vars),
                auto_pause=parent.auto_pause,
                auto_pause_memory=parent.auto_pause_memory,
                auto_resume=parent.auto_resume,
                egress=replace(parent.egress),
                public_traffic=not parent.traffic_access_token,
                mask_request_host=parent.mask_request_host,
                owner=parent.owner,
                standby_after=parent.standby_after,
            )
            with t.stage("children"):
                # The children restore from the snapshot while the parent does (under its
                # lock); a parent that fails to come back is marked lost, its children stay.
                kids = asyncio.ensure_future(
                    asyncio.gather(*(self._child(parent, req, snap) for _ in range(count)))
                )
                if parent_back is not None:
                    try:
                        await parent_back
                    except Exception:
                        log.exception("fork of %s: the parent did not come back", sandbox_id)
                crashpoint.hit("fork.parent_back")
                # What `diff`/`apply` compare the parent with by default (its layers are
                # held while the children run on them).
                back = self.table.find(sandbox_id)
                if back is not None:
                    back.fork_layers = list(snap.layers)
                    await self.table.save(back)
        with t.stage("children"):
            results = await kids
        # Children no longer need the image; their layers stay (they run on them).
        await self.templates.delete(snap)
        return list(results)

    async def from_snapshot(
        self, snapshot: TemplateRecord, count: int, timeout: int | None, owner: str | None
    ) -> list[ForkResult]:
        """`POST /sandboxes/{snapshotID}/fork`: `count` sandboxes created at once from a
        user's snapshot (by id or name), answered as a fork's children are; their lineage
        is the snapshot's (`snapshotID`, `snapshotOf`), not a fork's."""
        if snapshot.kind is not TemplateKind.SNAPSHOT or snapshot.internal:
            raise NotFound(f"sandbox or snapshot {snapshot.template_id!r} not found")
        if not 1 <= count <= MAX_CHILDREN:
            raise BadRequest(f"count must be between 1 and {MAX_CHILDREN}")
        check_timeout(timeout, self.ctx.settings)
        self.ctx.check_taking()
        # All or none, as a fork: refused up front when they would not fit the boot queue.
        self.sandboxes.booter.check_queue(count)
        req = CreateRequest(template_id=snapshot.template_id, timeout=timeout, owner=owner)
        return list(await asyncio.gather(*(self._made(req) for _ in range(count))))

    async def _made(self, req: CreateRequest) -> ForkResult:
        # Children queue for boot slots like any create (Booter.boot).
        try:
            c = await self.sandboxes.create(req, admitted=True)
        except AenvError as e:
            return ForkResult(error=e)
        except Exception as e:
            return ForkResult(error=AenvError(f"fork child failed: {e}"))
        return ForkResult(sandbox=c)

    async def _child(
        self, parent: SandboxRecord, req: CreateRequest, fork_point: TemplateRecord
    ) -> ForkResult:
        made = await self._made(req)
        c = made.sandbox
        if c is None:
            return made
        c.template_id = parent.template_id
        c.alias = parent.alias
        c.lineage = fork_lineage(parent, fork_point.template_id)
        c.fork_layers = list(fork_point.layers)
        await self.table.save(c)
        return ForkResult(sandbox=c)
