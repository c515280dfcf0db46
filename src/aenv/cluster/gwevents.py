"""Lifecycle events and webhooks through a gateway (docs/events.md).

Each event is recorded by the one node where the change happened (a move: by the node
that adopted the sandbox; a sandbox lost with its node: by a healthy node the gateway hands
it to, once, whichever gateway saw it first), and that node alone delivers it: so each
event goes out once. Listings of events merge every node's, in E2B's paging (offset, limit,
order). A webhook is the cluster's: kept in Redis and on every node under one id and
secret (a node takes what it missed at its next heartbeat); its delivery history and stats
are every node's together."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import uuid
from datetime import UTC, datetime
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import BadRequest, NotFound
from ..orchestrator import KILLED, MAX_EVENTS_LIMIT, LifecycleEvent, Webhook
from .directory import Directory
from .forward import NodeClient
from .records import NodeRecord
from .state import ClusterState

log = logging.getLogger("aenv.cluster")

_SANDBOX_EVENTS = re.compile(r"^/events/sandboxes(?:/([^/]+))?$")
_WEBHOOK = re.compile(r"^/events/webhooks/([^/]+)(/deliveries|/stats)?$")
# What a node answers per request of a merge (its own bound, E2B's).
PAGE = MAX_EVENTS_LIMIT


def _int(q: Any, name: str, default: int, lo: int, hi: int) -> int:
    raw = q.get(name)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer") from None
    if not lo <= v <= hi:
        raise BadRequest(f"{name} must be between {lo} and {hi}")
    return v


def _key(item: dict[str, Any]) -> tuple[str, str]:
    # RFC 3339 in UTC with `Z`, as every node writes them: text order is time order.
    return str(item.get("timestamp", "")), str(item.get("id", ""))


class GatewayEvents:
    def __init__(self, state: ClusterState, directory: Directory, nodes: NodeClient) -> None:
        self.state, self.directory, self.nodes = state, directory, nodes

    async def handle(self, request: Request) -> Response | None:
        """The answer to an events or webhooks request (None: not one of these)."""
        path, method = request.url.path, request.method
        if method == "GET" and (m := _SANDBOX_EVENTS.match(path)):
            return await self._events(request, m.group(1))
        if path == "/events/webhooks":
            if method == "POST":
                return await self._create(request)
            return self.nodes.passthrough(request, await self.directory.any_node())
        if m := _WEBHOOK.match(path):
            wid, sub = m.group(1), m.group(2)
            if sub == "/deliveries" and method == "GET":
                return await self._deliveries(request, wid)
            if sub == "/stats" and method == "GET":
                return await self._stats(request, wid)
            if sub is None and method == "PATCH":
                return await self._update(request, wid)
            if sub is None and method == "DELETE":
                return await self._delete(request, wid)
            return self.nodes.passthrough(request, await self.directory.any_node())
        return None

    # ------------------------------------------------------------------ events
    async def _events(self, request: Request, sandbox_id: str | None) -> Response:
        q = request.query_params
        offset = _int(q, "offset", 0, 0, 2**31)
        limit = _int(q, "limit", 10, 1, MAX_EVENTS_LIMIT)
        asc = q.get("orderAsc", "false").lower() == "true"
        params = [(k, v) for k, v in q.multi_items() if k in ("types", "orderAsc")]
        want = offset + limit
        nodes = await self.directory.healthy()

        async def of(node: NodeRecord) -> list[dict[str, Any]]:
            # Each node's first `offset + limit` in the order asked: the merge's page is
            # among them.
            got: list[dict[str, Any]] = []
            while len(got) < want:
                page = [*params, ("offset", str(len(got))), ("limit", str(PAGE))]
                resp = await self.nodes.fetch(request, node, "GET", request.url.path, params=page)
                if resp.status_code >= 400:
                    raise _Answer(resp)
                items = resp.json()
                got.extend(items)
                if len(items) < PAGE:
                    break
            return got

        answers = await asyncio.gather(*(of(n) for n in nodes), return_exceptions=True)
        merged: dict[str, dict[str, Any]] = {}
        for node, a in zip(nodes, answers, strict=True):
            if isinstance(a, _Answer):
                return _plain(a.resp)  # a bad query or key: the client's, the same everywhere
            if isinstance(a, BaseException):
                log.warning("events of node %s not read: %s", node.node_id, a)
                continue
            for item in a:
                merged.setdefault(str(item.get("id")), item)
        items = sorted(merged.values(), key=_key, reverse=not asc)
        return JSONResponse(items[offset:want])

    async def node_lost(self, sandbox_id: str, node_id: str, api_key: str | None) -> bool:
        """A sandbox that went with its node (not in the repository): recorded killed
        once, by whichever gateway saw it first, on a healthy node that delivers it.
        Whether this call recorded it."""
        if not await self.state.claim_lost(sandbox_id):
            return False
        entry = await self.state.roster_entry(node_id, sandbox_id)
        event = LifecycleEvent(
            id=str(uuid.uuid4()),
            type=KILLED,
            timestamp=datetime.now(UTC),
            sandbox_id=sandbox_id,
            template_id=(entry.template_id or "") if entry is not None else "",
            data={"kill_reason": "node_lost", "node_id": node_id},
        )
        try:
            node = await self.directory.any_node()
            await self.nodes.call(
                node, "POST", "/cluster/events", api_key=api_key, body=event.wire()
            )
        except Exception as e:
            await self.state.unclaim_lost(sandbox_id)  # the next request tries again
            log.warning("the loss of sandbox %s not recorded: %s", sandbox_id, e)
            return False
        return True

    # ------------------------------------------------------------------ webhooks
    async def _everywhere(
        self, request: Request, method: str, path: str, body: bytes = b""
    ) -> list[httpx.Response]:
        nodes = await self.directory.healthy()
        answers = await asyncio.gather(
            *(self.nodes.fetch(request, n, method, path, body=body) for n in nodes),
            return_exceptions=True,
        )
        out = []
        for node, a in zip(nodes, answers, strict=True):
            if isinstance(a, BaseException):
                log.warning("webhook %s on node %s: %s", method, node.node_id, a)
                continue
            out.append(a)
        return out

    async def _keep(self, request: Request, w: Webhook) -> Response:
        """Puts the webhook on the first node (which checks it), then in Redis and on the
        others."""
        body = w.to_doc().encode()
        first = await self.directory.any_node()
        path = f"/cluster/webhooks/{w.id}"
        resp = await self.nodes.fetch(request, first, "PUT", path, body=body)
        if resp.status_code >= 400:
            return _plain(resp)
        await self.state.put_webhook(w.id, w.to_doc())
        await self._everywhere(request, "PUT", path, body)
        return _plain(resp)

    async def _create(self, request: Request) -> Response:
        doc = _body(await request.body())
        given = doc.get("signatureSecret")
        w = Webhook(
            id=str(uuid.uuid4()),
            name=str(doc.get("name") or ""),
            url=str(doc.get("url") or ""),
            events=list(doc.get("events") or []),
            secret=str(given) if given else secrets.token_urlsafe(24),
            enabled=bool(doc.get("enabled", True)),
        )
        resp = await self._keep(request, w)
        if resp.status_code >= 400:
            return resp
        out = json.loads(bytes(resp.body))
        if not given:
            out["signatureSecret"] = w.secret
        return JSONResponse(out, status_code=201)

    async def _update(self, request: Request, webhook_id: str) -> Response:
        have = await self.state.webhook(webhook_id)
        if have is None:
            raise NotFound(f"webhook {webhook_id!r} not found")
        w = Webhook.from_doc(have)
        doc = _body(await request.body())
        for field in ("name", "url", "events", "enabled"):
            if doc.get(field) is not None:
                setattr(w, field, doc[field])
        if doc.get("signatureSecret"):
            w.secret = str(doc["signatureSecret"])
        return await self._keep(request, w)

    async def _delete(self, request: Request, webhook_id: str) -> Response:
        had = await self.state.delete_webhook(webhook_id)
        answers = await self._everywhere(request, "DELETE", request.url.path)
        if had or any(a.status_code < 300 for a in answers):
            return Response(status_code=200)
        raise NotFound(f"webhook {webhook_id!r} not found")

    async def _deliveries(self, request: Request, webhook_id: str) -> Response:
        q = request.query_params
        offset = _int(q, "offset", 0, 0, 10**6)
        limit = _int(q, "limit", 10, 1, MAX_EVENTS_LIMIT)
        # Each node's newest (a history deeper than its first page is its own to page).
        page = [("offset", "0"), ("limit", str(min(PAGE, offset + limit)))]
        nodes = await self.directory.healthy()
        answers = await asyncio.gather(
            *(self.nodes.fetch(request, n, "GET", request.url.path, params=page) for n in nodes),
            return_exceptions=True,
        )
        items: list[dict[str, Any]] = []
        found = False
        for a in answers:
            if isinstance(a, BaseException) or a.status_code >= 400:
                continue
            found = True
            items.extend(a.json())
        if not found:
            raise NotFound(f"webhook {webhook_id!r} not found")
        items.sort(key=_key, reverse=True)
        return JSONResponse(items[offset : offset + limit])

    async def _stats(self, request: Request, webhook_id: str) -> Response:
        answers = [a for a in await self._everywhere(request, "GET", request.url.path)]
        docs = [a.json() for a in answers if a.status_code < 300]
        if not docs:
            raise NotFound(f"webhook {webhook_id!r} not found")
        out: dict[str, Any] = {
            k: sum(int(d.get(k) or 0) for d in docs)
            for k in ("delivered", "failed", "dropped", "backlog")
        }
        for k in ("lastDeliveredAt", "lastFailedAt"):
            times = [str(d[k]) for d in docs if d.get(k)]
            if times:
                out[k] = max(times, key=_when)
        failed = [d for d in docs if d.get("lastFailedAt") and d.get("lastError")]
        if failed:
            out["lastError"] = max(failed, key=lambda d: _when(d["lastFailedAt"]))["lastError"]
        return JSONResponse(out)


def _when(text: str) -> datetime:
    t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=UTC)


class _Answer(Exception):
    """A node's error answer to pass on as it is."""

    def __init__(self, resp: httpx.Response) -> None:
        super().__init__(resp.status_code)
        self.resp = resp


def _body(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw or b"{}")
    except json.JSONDecodeError:
        raise BadRequest("the body is not JSON") from None
    if not isinstance(doc, dict):
        raise BadRequest("the body must be a JSON object")
    return doc


def _plain(resp: httpx.Response) -> Response:
    return Response(
        resp.content,
        status_code=resp.status_code,
        media_type=resp.headers.get("content-type", "application/json"),
    )
