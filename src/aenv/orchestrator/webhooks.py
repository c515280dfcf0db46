"""Delivering lifecycle events to webhooks: one worker per webhook (not per sandbox) takes
what its outbox has due, POSTs it signed as E2B signs (`e2b-signature`, with E2B's
`e2b-webhook-id`, `e2b-delivery-id` and `e2b-signature-version` headers) and records the
attempt. A failed attempt is retried with exponential backoff up to a cap, for as long as
the event is kept; each sandbox's events go out in order (its next waits for the one
before), different sandboxes' at once. Nothing here is awaited by a sandbox operation: a
slow or dead receiver only grows its own outbox, which the store bounds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import httpx

from .. import __version__
from .eventrecords import DELIVERED, FAILED, Delivery, Due, Webhook, signature
from .eventstore import EventStore

log = logging.getLogger("aenv.webhooks")

Run = Callable[..., Awaitable[Any]]

# Events of different sandboxes sent to one webhook at once.
CONCURRENCY = 8


def backoff(attempt: int, base: float, cap: float) -> float:
    """Seconds before attempt `attempt + 1`: doubling from `base`, at most `cap`, with a
    tenth of jitter so that many webhooks' retries do not land together."""
    delay = min(cap, base * 2 ** max(0, attempt - 1))
    return delay * random.uniform(0.9, 1.0)


class Deliverer:
    def __init__(
        self,
        run: Run,
        store: EventStore,
        *,
        timeout: float,
        backoff_base: float,
        backoff_cap: float,
        counted: Callable[[str], None],
    ) -> None:
        # `run(fn, *args)`: `fn` on the store's own thread.
        self._run = run
        self._store = store
        self._base, self._cap = backoff_base, backoff_cap
        self._counted = counted
        self._client = httpx.AsyncClient(timeout=timeout, follow_redirects=False)
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._wake: dict[str, asyncio.Event] = {}

    def watch(self, webhook_id: str) -> None:
        """Starts the webhook's worker (if it has none)."""
        if webhook_id in self._workers:
            self.poke([webhook_id])
            return
        self._wake[webhook_id] = asyncio.Event()
        task = asyncio.create_task(self._work(webhook_id), name=f"aenv-webhook-{webhook_id}")
        self._workers[webhook_id] = task

    async def forget(self, webhook_id: str) -> None:
        task = self._workers.pop(webhook_id, None)
        self._wake.pop(webhook_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def poke(self, webhook_ids: list[str]) -> None:
        """New events for these webhooks (in the event loop)."""
        for w in webhook_ids:
            ev = self._wake.get(w)
            if ev is not None:
                ev.set()

    async def close(self) -> None:
        for w in list(self._workers):
            await self.forget(w)
        await self._client.aclose()

    async def _work(self, webhook_id: str) -> None:
        wake = self._wake[webhook_id]
        while True:
            wake.clear()
            try:
                hook: Webhook | None = await self._run(self._store.webhook, webhook_id)
                if hook is None:
                    return
                due: list[Due] = []
                if hook.enabled:
                    due = await self._run(self._store.due, webhook_id, time.time(), CONCURRENCY)
                if due:
                    await asyncio.gather(*(self._send(hook, d) for d in due))
                    continue
                nxt = await self._run(self._store.next_retry, webhook_id) if hook.enabled else None
            except asyncio.CancelledError:
                raise
            except Exception:
                # The worker must outlive a bad moment of the disk: it looks again later.
                log.exception("webhook %s: delivery round failed", webhook_id)
                nxt = time.time() + self._cap
            wait = None if nxt is None else max(0.0, nxt - time.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), wait)

    async def _send(self, hook: Webhook, d: Due) -> None:
        delivery_id = str(uuid.uuid4())
        headers = {
            "content-type": "application/json",
            "user-agent": f"aenv/{__version__}",
            "e2b-webhook-id": hook.id,
            "e2b-delivery-id": delivery_id,
            "e2b-signature-version": "v1",
            "e2b-signature": signature(hook.secret, d.body),
        }
        started = time.monotonic()
        status: int | None = None
        error: str | None = None
        try:
            resp = await self._client.post(hook.url, content=d.body, headers=headers)
            status = resp.status_code
            if not 200 <= status < 300:
                error = f"the receiver answered HTTP {status}"
        except httpx.HTTPError as e:
            error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        ms = int((time.monotonic() - started) * 1000)
        attempt = d.attempts + 1
        outcome = DELIVERED if error is None else FAILED
        retry_at = None if error is None else time.time() + backoff(attempt, self._base, self._cap)
        record = Delivery(
            delivery_id,
            hook.id,
            d.event.id,
            d.event.type,
            d.sandbox_id,
            datetime.now(UTC),
            attempt,
            outcome,
            status,
            ms,
            error,
        )
        if error is not None:
            log.info(
                "webhook %s: event %s (%s) not delivered, attempt %d: %s",
                hook.id,
                d.event.id,
                d.event.type,
                attempt,
                error,
            )
        await self._run(self._store.settle, record, d.seq, retry_at)
        self._counted(outcome)
