"""A sandbox over its memory loses a process, not its life: the runtime says when a running
sandbox uses more memory than its size (`Runtime.on_memory_pressure`, see
`runtime/memguard.py`), and envd inside kills the largest process (`envd/oomkill.py`), as a
VM's kernel would. Right after a kill the host's numbers lag (the sentry gives freed
memory back a while later), so for KILL_GRACE seconds envd kills again only when the
sandbox counts itself short of memory; otherwise the node's word is enough (the sentry's
own memory may be what is short, which the sandbox cannot see). The kill is recorded: the sandbox's logs ("process killed: out of
memory", with the process and its memory) and the node's `aenv_sandbox_oom_kills` counter."""

from __future__ import annotations

import logging
import time

import httpx

from ..domain import SandboxState
from ..errors import AenvError
from ..logctx import sandbox_context
from ..runtime.base import Instance, Runtime
from . import eventrecords as ev
from .context import NodeContext
from .envd_pool import EnvdPool
from .events import Events
from .logs import SandboxLogs
from .nodeinfo import NodeStats
from .table import SandboxTable

log = logging.getLogger("aenv.orchestrator")

KILL_GRACE = 5.0


class OomGuard:
    def __init__(
        self,
        ctx: NodeContext,
        table: SandboxTable,
        runtime: Runtime,
        envd: EnvdPool,
        logs: SandboxLogs,
        stats: NodeStats,
        events: Events,
    ) -> None:
        self.ctx, self.table, self.envd, self.logs, self.stats = ctx, table, envd, logs, stats
        self.events = events
        self._busy: set[str] = set()  # sandboxes with a kill in flight
        self._last_kill: dict[str, float] = {}  # monotonic time, per sandbox
        runtime.on_memory_pressure(self.pressed)

    def pressed(self, inst: Instance) -> None:
        """(In the event loop, from the runtime.) One kill at a time per sandbox: the events
        of one allocation come in bursts."""
        if inst.sandbox_id in self._busy:
            return
        self._busy.add(inst.sandbox_id)
        self.ctx.spawn(self._kill(inst), name="aenv-oom")

    async def _kill(self, inst: Instance) -> None:
        sid = inst.sandbox_id
        try:
            with sandbox_context(sid):
                r = self.table.find(sid)
                if r is None or r.state is not SandboxState.RUNNING or r.instance is None:
                    self._last_kill.pop(sid, None)
                    return
                if r.instance.id != inst.id or r.address is None:
                    return
                recent = time.monotonic() - self._last_kill.get(sid, -KILL_GRACE) < KILL_GRACE
                envd = self.envd.at(r.address, r.envd_access_token)
                try:
                    killed = await envd.kill_largest(force=not recent)
                except (AenvError, httpx.HTTPError, ValueError) as e:
                    log.warning("sandbox %s is out of memory; envd could not kill: %s", sid, e)
                    return
                if killed is None:
                    return
                now = time.monotonic()
                for old in [k for k, t in self._last_kill.items() if now - t >= KILL_GRACE]:
                    del self._last_kill[old]
                self._last_kill[sid] = now
                self.stats.oom_kills.inc()
                log.info(
                    "sandbox %s out of memory: killed pid %s (%s, %d MiB)",
                    sid,
                    killed.get("pid"),
                    killed.get("cmd"),
                    int(killed.get("rss_bytes") or 0) >> 20,
                )
                self.logs.note(
                    sid,
                    "process killed: out of memory",
                    level="warn",
                    pid=killed.get("pid"),
                    cmd=killed.get("cmd"),
                    rssBytes=killed.get("rss_bytes"),
                    memoryMB=r.memory_mb,
                )
                self.events.record(
                    ev.OOM,
                    r,
                    pid=killed.get("pid"),
                    cmd=killed.get("cmd"),
                    rss_bytes=killed.get("rss_bytes"),
                    memory_mb=r.memory_mb,
                )
        finally:
            self._busy.discard(sid)
