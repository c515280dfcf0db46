"""Lifecycle events: every change of a sandbox's life the node makes (created, paused with
its tier, resumed, updated, snapshot taken, forked, moved, killed with its cause, a process
killed for memory) is recorded durably with a time and an id, kept `AENV_EVENTS_RETENTION_DAYS`
(7, as E2B keeps them), queryable in E2B's shape, and delivered to the webhooks that want
it (`webhooks.py`).

`record` is what the parts call where they note the change in the sandbox's logs: it never
waits (the write goes to the store's own thread, in the order recorded), so neither the
disk nor a receiver slows a sandbox operation."""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge

from ..background import Periodic
from ..domain import SandboxRecord
from ..errors import BadRequest, NotFound
from .context import NodeContext
from .eventrecords import (
    DELIVERED,
    DROPPED,
    EVENT_TYPES,
    OUTCOMES,
    Delivery,
    LifecycleEvent,
    Webhook,
    WebhookStats,
    execution_id,
    iso,
)
from .eventstore import EventStore
from .webhooks import Deliverer

log = logging.getLogger("aenv.events")

T = TypeVar("T")

# E2B's bound of `limit` on the events routes.
MAX_LIMIT = 100
PRUNE_SECONDS = 3600.0


class Events:
    def __init__(self, ctx: NodeContext, registry: CollectorRegistry) -> None:
        s = ctx.settings
        self.ctx = ctx
        self.retention = timedelta(days=s.events_retention_days)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="aenv-events")
        self._store = EventStore(s.events_path, s.webhook_backlog)
        self._deliveries = Counter(
            "aenv_webhook_deliveries",
            "Webhook delivery attempts, by outcome (delivered, failed: retried later, "
            "dropped: an event given up, past the backlog bound or the retention)",
            ["outcome"],
            registry=registry,
        )
        for outcome in OUTCOMES:
            self._deliveries.labels(outcome)
        self._backlog_gauge = Gauge(
            "aenv_webhook_backlog",
            "Events waiting for delivery, over all webhooks",
            registry=registry,
        )
        self._backlog = 0
        self._deliverer = Deliverer(
            self._run,
            self._store,
            timeout=s.webhook_timeout,
            backoff_base=s.webhook_backoff,
            backoff_cap=s.webhook_backoff_max,
            counted=self._counted,
        )
        self._pruner = Periodic("events-prune", PRUNE_SECONDS, self.prune, log)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    # ---------------------------------------------------------------- life
    async def start(self, *, timers: bool = True) -> None:
        await self.prune()
        self._set_backlog(await self._run(self._store.backlog_of))
        for w in await self._run(self._store.webhooks):
            self._deliverer.watch(w.id)
        if timers:
            self._pruner.start()

    async def close(self) -> None:
        await self._pruner.stop()
        await self._deliverer.close()
        # Whatever was recorded is written before the store closes.
        await self._run(self._store.close)
        self._pool.shutdown(wait=True)

    # ---------------------------------------------------------------- recording
    def record(self, event_type: str, r: SandboxRecord, **data: Any) -> None:
        """A change in `r`'s life, now (never waits: see the module's docstring)."""
        body: dict[str, Any] = {}
        if r.metadata:
            body["sandbox_metadata"] = dict(r.metadata)
        body.update({k: v for k, v in data.items() if v is not None})
        self.append(
            LifecycleEvent(
                id=str(uuid.uuid4()),
                type=event_type,
                timestamp=self.ctx.now(),
                sandbox_id=r.sandbox_id,
                template_id=r.template_id,
                execution_id=execution_id(r.sandbox_id, r.started_at),
                data=body or None,
            )
        )

    def execution(self, r: SandboxRecord) -> dict[str, Any]:
        """E2B's `eventData.execution` of killed and paused events."""
        return {
            "started_at": iso(r.started_at),
            "vcpu_count": r.cpu_count,
            "memory_mb": r.memory_mb,
            "execution_time": max(0, int((self.ctx.now() - r.started_at).total_seconds() * 1000)),
        }

    def append(self, e: LifecycleEvent) -> None:
        """Records a made event (one the gateway saw comes this way too)."""
        # The loop of the operation that recorded it hears when it is written.
        loop = asyncio.get_running_loop()
        fut = self._pool.submit(self._store.append, e, time.time())
        fut.add_done_callback(functools.partial(self._appended, e, loop))

    def _appended(
        self,
        e: LifecycleEvent,
        loop: asyncio.AbstractEventLoop,
        fut: Future[tuple[list[str], int]],
    ) -> None:
        # On the store's thread: the rest is the event loop's.
        exc = fut.exception()
        if exc is not None:
            log.error("lifecycle event %s of %s not recorded: %s", e.type, e.sandbox_id, exc)
            return
        hooks, dropped = fut.result()
        if not loop.is_closed():
            loop.call_soon_threadsafe(self._fan_out, hooks, dropped)

    def _fan_out(self, hooks: list[str], dropped: int) -> None:
        if dropped:
            log.warning("webhook backlog full: %d oldest undelivered event(s) dropped", dropped)
            self._deliveries.labels(DROPPED).inc(dropped)
        self._set_backlog(self._backlog + len(hooks) - dropped)
        self._deliverer.poke(hooks)

    def _counted(self, outcome: str) -> None:
        self._deliveries.labels(outcome).inc()
        if outcome == DELIVERED:
            self._set_backlog(self._backlog - 1)

    def _set_backlog(self, n: int) -> None:
        self._backlog = max(0, n)
        self._backlog_gauge.set(self._backlog)

    async def prune(self) -> None:
        """Forgets what is older than the retention."""
        cut = self.ctx.now() - self.retention
        wall = time.time() - self.retention.total_seconds()
        removed, dropped = await self._run(self._store.prune, cut, wall)
        if dropped:
            log.warning("%d webhook deliveries dropped: undelivered past the retention", dropped)
            self._deliveries.labels(DROPPED).inc(dropped)
            self._set_backlog(self._backlog - dropped)
        if removed:
            log.info("%d lifecycle events past the retention forgotten", removed)

    # ---------------------------------------------------------------- reading
    async def query(
        self,
        *,
        sandbox_id: str | None = None,
        types: Sequence[str] = (),
        offset: int = 0,
        limit: int = 10,
        ascending: bool = False,
    ) -> list[str]:
        """Events as E2B's JSON objects (text, as stored), newest first unless
        `ascending`."""
        check_types(types)
        if offset < 0:
            raise BadRequest("offset must be 0 or more")
        if not 1 <= limit <= MAX_LIMIT:
            raise BadRequest(f"limit must be between 1 and {MAX_LIMIT}")
        since = self.ctx.now() - self.retention
        return await self._run(
            functools.partial(
                self._store.query,
                sandbox_id=sandbox_id,
                types=list(dict.fromkeys(types)),
                offset=offset,
                limit=limit,
                ascending=ascending,
                since=since,
            )
        )

    # ---------------------------------------------------------------- webhooks
    async def webhooks(self) -> list[Webhook]:
        return await self._run(self._store.webhooks)

    async def webhook(self, webhook_id: str) -> Webhook:
        w = await self._run(self._store.webhook, webhook_id)
        if w is None:
            raise NotFound(f"webhook {webhook_id!r} not found")
        return w

    async def create_webhook(
        self,
        *,
        name: str,
        url: str,
        events: Sequence[str],
        secret: str | None,
        enabled: bool = True,
        webhook_id: str | None = None,
    ) -> Webhook:
        """A new webhook (`secret` None: one is made, shown once by the caller).
        `webhook_id`: the id a gateway gave it (every node keeps it under the same)."""
        check_url(url)
        check_types(events)
        w = Webhook(
            id=webhook_id or str(uuid.uuid4()),
            name=name,
            url=url,
            events=list(dict.fromkeys(events)),
            secret=secret or secrets.token_urlsafe(24),
            enabled=enabled,
        )
        await self._run(self._store.put_webhook, w)
        self._deliverer.watch(w.id)
        return w

    async def update_webhook(
        self,
        webhook_id: str,
        *,
        name: str | None = None,
        url: str | None = None,
        events: Sequence[str] | None = None,
        enabled: bool | None = None,
        secret: str | None = None,
    ) -> Webhook:
        w = await self.webhook(webhook_id)
        if url is not None:
            check_url(url)
            w.url = url
        if events is not None:
            check_types(events)
            w.events = list(dict.fromkeys(events))
        if name is not None:
            w.name = name
        if enabled is not None:
            w.enabled = enabled
        if secret is not None:
            w.secret = secret
        await self._run(self._store.put_webhook, w)
        self._deliverer.watch(w.id)  # enabled again: what waited goes now
        return w

    async def put_webhook(self, w: Webhook) -> Webhook:
        """Keeps `w` as it is given, id and secret included (a cluster's webhook, which
        every node keeps under one id); nothing is written if it is kept so already."""
        check_url(w.url)
        check_types(w.events)
        have = await self._run(self._store.webhook, w.id)
        if have is None or have.to_doc() != w.to_doc():
            await self._run(self._store.put_webhook, w)
        self._deliverer.watch(w.id)
        return w

    async def sync(self, docs: dict[str, str], deleted: set[str]) -> None:
        """A cluster's webhooks as Redis has them: kept here as they are there, and those
        deleted there deleted here."""
        for doc in docs.values():
            try:
                await self.put_webhook(Webhook.from_doc(doc))
            except (BadRequest, ValueError, KeyError) as e:
                log.warning("a cluster webhook not taken: %s", e)
        for gone in deleted - set(docs):
            if await self._run(self._store.webhook, gone) is not None:
                await self.delete_webhook(gone)

    async def delete_webhook(self, webhook_id: str) -> None:
        await self._deliverer.forget(webhook_id)
        if not await self._run(self._store.delete_webhook, webhook_id):
            raise NotFound(f"webhook {webhook_id!r} not found")
        self._set_backlog(await self._run(self._store.backlog_of))

    async def deliveries(self, webhook_id: str, offset: int, limit: int) -> list[Delivery]:
        await self.webhook(webhook_id)
        return await self._run(self._store.deliveries, webhook_id, offset, limit)

    async def stats(self, webhook_id: str) -> WebhookStats:
        await self.webhook(webhook_id)
        return await self._run(self._store.stats, webhook_id)


def check_types(types: Sequence[str]) -> None:
    bad = [t for t in types if t not in EVENT_TYPES]
    if bad:
        raise BadRequest(
            f"unknown event type(s) {', '.join(map(repr, bad))}: one of {', '.join(EVENT_TYPES)}"
        )


def check_url(url: str) -> None:
    if not url.startswith(("http://", "https://")) or len(url) > 2048:
        raise BadRequest(f"url must be an http:// or https:// URL, got {url!r}")
