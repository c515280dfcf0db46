"""`aenv gateway`: one port in front of many nodes, E2B-compatible, holding no state of its
own (it is all in Redis), so any number of gateways serve one cluster.

Control plane: a create goes where the scheduler places it (a node that turns it down is
skipped), a request about a sandbox, template build or snapshot to the node that holds it,
listings of sandboxes, snapshots, templates and nodes are merged across nodes (one cursor
pages through all of them: node cursors are positions, not offsets), anything else to one
healthy node. Data plane: the node's own router, by sandbox id, streams passed through."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from ..config import Settings
from ..console import browser_redirect, console_routes
from ..domain import DEFAULT_TEMPLATE, Upstream
from ..errors import AenvError, BadRequest, NotFound, SandboxNotFound, Unauthorized, Unavailable
from ..keys import presented_key
from ..proxy._common import ROUTING_HEADERS, Scope
from ..proxy.dispatch import Route as SandboxRoute
from ..proxy.dispatch import SandboxRouter
from ..serving import Lifespan
from ..telemetry import set_route
from .aggregate import BulkJoin, merge_pages, node_view
from .answers import json_list, json_object, plain
from .directory import Directory, NodeLost
from .forward import NodeClient, NodeError, NodeUnreachable
from .gwevents import GatewayEvents
from .gwtemplates import GatewayTemplates
from .metrics import GatewayMetrics, route_template
from .records import NodeRecord
from .scheduler import Placement, Scheduler
from .signing import SignerLookup
from .state import ClusterState

log = logging.getLogger("aenv.cluster")

_SANDBOX = re.compile(r"^/(?:v\d+/)?sandboxes/([A-Za-z0-9][A-Za-z0-9_-]*)(/.*)?$")
_TEMPLATE = re.compile(r"^/(?:v\d+/)?templates/([^/]+)(/.*)?$")
_SNAPSHOT = re.compile(r"^/snapshots/([^/]+)$")
_NODE = re.compile(r"^/nodes/([^/]+)$")
_BUILD_FILES = re.compile(r"^/build-files/([^/]+)$")
_FILES_LINK = re.compile(r"^/templates/([^/]+)/files/([^/]+)$")
_BUILD_REQUESTS = ("/templates", "/v2/templates", "/v3/templates")
_RESUMES = ("/connect", "/resume")
# The bulk lifecycle routes (api/routes/bulk.py): every node acts on its own matches.
_BULK = {("DELETE", "/sandboxes"), ("POST", "/sandboxes/pause"), ("POST", "/sandboxes/timeout")}
TOTAL_RUNNING = "X-Total-Running"
# A create a node turns down (full, draining) is tried on this many others.
CREATE_TRIES = 3


class Gateway:
    def __init__(
        self,
        settings: Settings,
        state: ClusterState,
        directory: Directory,
        nodes: NodeClient,
        scheduler: Scheduler,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.state = state
        self.directory = directory
        self.nodes = nodes
        self.scheduler = scheduler
        self.metrics = metrics or GatewayMetrics()
        self.events = GatewayEvents(state, directory, nodes)
        self.templates = GatewayTemplates(
            settings, state, directory, nodes, scheduler, self.metrics
        )

    # ------------------------------------------------------------------ entry
    async def handle(self, request: Request) -> Response:
        # Reported under the node API's template, not the catch-all route that took it.
        set_route(request.scope, route_template(request.url.path))
        try:
            return await self._route(request)
        except AenvError as e:
            if isinstance(e, NodeLost):
                await self.events.node_lost(e.sandbox_id, e.node_id, self._key())
            if (reason := routing_error(e)) is not None:
                self.metrics.routing_error(reason)
            return JSONResponse(e.to_json(), status_code=e.status)

    async def _route(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        if path == "/metrics" and method in ("GET", "HEAD"):
            return await self._metrics(request)
        if path == "/health":
            return JSONResponse({"status": "ok", "role": "gateway"})
        if path == "/" and (to_console := browser_redirect(request)) is not None:
            return to_console
        if method == "GET" and path in ("/sandboxes", "/v2/sandboxes"):
            return await self._merged(request, "startedAt", "sandboxID", order_default="desc")
        if method == "POST" and path in ("/sandboxes", "/v2/sandboxes", "/sandboxes-cold"):
            return await self._create(request)
        if method == "GET" and path == "/sandboxes/metrics":
            return await self._merged_metrics(request)
        if (method, path) in _BULK:  # before _SANDBOX, which reads `pause` as an id
            return await self._bulk(request)
        if path.startswith("/events/"):
            answer = await self.events.handle(request)
            if answer is not None:
                return answer
        if m := _SANDBOX.match(path):
            return await self._sandbox(request, m.group(1), m.group(2) or "")
        if method == "GET" and path == "/snapshots":
            return await self._merged(request, "createdAt", "snapshotID")
        if method == "GET" and path in ("/templates", "/v2/templates"):
            return await self._merged(request, "createdAt", "templateID")
        if method == "POST" and path in _BUILD_REQUESTS:
            return await self.templates.build_request(request)
        if path == "/nodes" and method == "GET":
            return await self._nodes()
        if m := _NODE.match(path):
            return await self._node(request, m.group(1))
        if m := _FILES_LINK.match(path):
            return await self.templates.files_link(request, m.group(1), m.group(2))
        if m := _BUILD_FILES.match(path):
            node = await self.templates.node_of_files(m.group(1))
            return self.nodes.passthrough(request, node)
        if path == "/templates/tags" and method in ("POST", "DELETE"):
            return await self.templates.tags(request)
        if m := _TEMPLATE.match(path):
            return await self.templates.template(request, m.group(1))
        if m := _SNAPSHOT.match(path):
            return await self.templates.template(request, m.group(1))
        return self.nodes.passthrough(request, await self.directory.any_node())

    # ------------------------------------------------------------------ sandboxes
    async def _create(self, request: Request) -> Response:
        body = await request.body()
        doc = json_object(body)
        place = Placement(
            template_id=str(doc.get("templateID") or doc.get("image") or DEFAULT_TEMPLATE),
            cpu_count=int(doc.get("cpuCount") or self.settings.default_cpu_count),
            memory_mb=int(doc.get("memoryMB") or self.settings.default_memory_mb),
        )
        tried: set[str] = set()
        last: Response | None = None
        for _ in range(CREATE_TRIES):
            nodes = [n for n in await self.directory.schedulable() if n.node_id not in tried]
            if not nodes:
                break
            preferred = await self.state.template_node(place.template_id)
            node = next((n for n in nodes if n.node_id == preferred and last), None)
            node = node or self.scheduler.place(place, nodes)
            tried.add(node.node_id)
            try:
                resp = await self.nodes.send(request, node, body=body)
            except NodeUnreachable:
                self.metrics.placed("sandbox", "failed")
                raise
            if resp.status_code < 400:
                sandbox_id = json_object(resp.content).get("sandboxID")
                if isinstance(sandbox_id, str):
                    await self.directory.bind(sandbox_id, node.node_id)
                self.metrics.placed("sandbox", "placed")
                return plain(resp)
            last = plain(resp)
            # Full, draining, or a template only another node has yet: try another node.
            if resp.status_code not in (404, 409, 429, 503, 507):
                self.metrics.placed("sandbox", "failed")
                return last
        if last is not None:
            self.metrics.placed("sandbox", "turned_down")
            return last
        self.metrics.placed("sandbox", "no_node")
        return JSONResponse({"code": 503, "message": "no node is ready to take sandboxes"}, 503)

    async def _sandbox(self, request: Request, sandbox_id: str, rest: str) -> Response:
        resume = request.method == "POST" and rest in _RESUMES
        fork = request.method == "POST" and rest == "/fork"
        try:
            node = await self.directory.usable(
                sandbox_id, self._release, self._adopt, resume=resume
            )
        except NotFound:
            if not fork:
                raise
            # Not a sandbox: aenv's fork of a snapshot by id or name (docs/fork-tree.md),
            # sent where that snapshot is, as a create from it would be.
            node = await self.templates.node_of(sandbox_id)
        if fork:
            resp = await self.nodes.send(request, node)
            for item in json_list(resp.content):
                child = (item.get("sandbox") or {}).get("sandboxID")
                if isinstance(child, str):
                    await self.directory.bind(child, node.node_id)
            return plain(resp)
        if request.method == "POST" and rest == "/snapshots":
            resp = await self.nodes.send(request, node)
            snap = json_object(resp.content).get("snapshotID")
            if resp.status_code < 400 and isinstance(snap, str):
                # Creates from it go to this node until the repository has it.
                for key in (snap, json_object(await request.body()).get("name")):
                    if isinstance(key, str) and key:
                        await self.state.bind_template(key, node.node_id)
            return plain(resp)
        if request.method == "DELETE" and not rest:
            resp = await self.nodes.send(request, node)
            if resp.status_code < 300:
                await self.state.unbind(sandbox_id)
                self.directory.forget(sandbox_id)
            return plain(resp)
        return self.nodes.passthrough(request, node)

    async def _release(self, node: NodeRecord, sandbox_id: str) -> str | None:
        try:
            doc = await self.nodes.call(
                node, "POST", f"/cluster/sandboxes/{sandbox_id}/release", api_key=self._key()
            )
        except NodeError as e:
            if e.status in (404, 409):
                return None  # not hibernated into the repository (or gone): it stays
            raise
        return str(doc["image"])

    async def _adopt(self, node: NodeRecord, sandbox_id: str, image: str) -> None:
        await self.nodes.call(
            node,
            "POST",
            f"/cluster/sandboxes/{sandbox_id}/adopt",
            api_key=self._key(),
            body={"image": image},
        )

    def _key(self) -> str | None:
        return self.settings.api_key

    # ------------------------------------------------------------------ listings
    async def _merged(
        self, request: Request, time_field: str, id_field: str, order_default: str = "asc"
    ) -> Response:
        nodes = await self.directory.healthy()
        answers = await asyncio.gather(
            *(self.nodes.send(request, n) for n in nodes), return_exceptions=True
        )
        pages: list[tuple[list[dict[str, Any]], bool]] = []
        for node, a in zip(nodes, answers, strict=True):
            if isinstance(a, BaseException):
                log.warning("listing on node %s failed: %s", node.node_id, a)
                continue
            if a.status_code >= 400:
                return plain(a)  # a bad query or key is the client's, the same everywhere
            pages.append((json_list(a.content), bool(a.headers.get("x-next-token"))))
        limit = request.query_params.get("limit")
        order = request.query_params.get("order", order_default)
        items, token = merge_pages(
            pages,
            time_field=time_field,
            id_field=id_field,
            desc=order == "desc",
            limit=int(limit) if limit and limit.isdigit() else None,
        )
        headers = {"x-next-token": token} if token else {}
        # E2B's count of running sandboxes matching the filters: each node's, summed.
        totals = [a.headers.get(TOTAL_RUNNING) for a in answers if not isinstance(a, BaseException)]
        if any(t is not None for t in totals):
            headers[TOTAL_RUNNING] = str(sum(int(t) for t in totals if t and t.isdigit()))
        return JSONResponse(items, headers=headers)

    async def _merged_metrics(self, request: Request) -> Response:
        nodes = await self.directory.healthy()
        answers = await asyncio.gather(
            *(self.nodes.send(request, n) for n in nodes), return_exceptions=True
        )
        merged: dict[str, Any] = {}
        for a in answers:
            if isinstance(a, BaseException) or a.status_code >= 400:
                continue
            for key, value in json_object(a.content).items():
                if isinstance(value, dict):
                    merged.setdefault(key, {}).update(value)
                elif isinstance(value, list):
                    merged.setdefault(key, []).extend(value)
        return JSONResponse(merged)

    async def _bulk(self, request: Request) -> Response:
        """A bulk operation on every healthy node, the answers joined (`BulkJoin`): a 200
        even when a node was not reached, since the others' acts are not undone."""
        body = await request.body()
        nodes = await self.directory.healthy()
        answers = await asyncio.gather(
            *(self.nodes.send(request, n, body=body) for n in nodes), return_exceptions=True
        )
        joined = BulkJoin()
        for node, a in zip(nodes, answers, strict=True):
            if isinstance(a, BaseException):
                log.warning("bulk %s on node %s failed: %s", request.url.path, node.node_id, a)
                joined.unreachable.append(node.node_id)
            elif a.status_code >= 400:
                return plain(a)  # an empty query or a bad body: the same on every node
            elif (ids := joined.add(json_object(a.content))) and request.method == "DELETE":
                for sandbox_id in ids:  # killed: unbound, as a kill of one is
                    await self.state.unbind(sandbox_id)
                    self.directory.forget(sandbox_id)
        return JSONResponse(joined.doc())

    # ------------------------------------------------------------------ metrics
    async def _metrics(self, request: Request) -> Response:
        """This gateway's own registry (each node serves its own), with the key a node's
        `/metrics` takes: AENV_API_KEY, which every gateway and node of a cluster share."""
        key = presented_key(request.headers)
        fixed = self.settings.api_key
        if fixed is None:
            raise Unauthorized(
                "this gateway has no AENV_API_KEY to check keys against: "
                "scrape AENV_METRICS_LISTEN instead"
            )
        if not hmac.compare_digest(key.encode(), fixed.encode()):
            raise Unauthorized("Invalid API key")
        body = await self.metrics.exposition(self.directory.nodes)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ nodes
    async def _nodes(self) -> Response:
        return JSONResponse([node_view(n) for n in await self.directory.nodes(fresh=True)])

    async def _node(self, request: Request, node_id: str) -> Response:
        node = await self.directory.node(node_id)
        if request.method == "POST":
            status = json_object(await request.body()).get("status")
            if status not in ("ready", "draining"):
                raise BadRequest("status must be ready or draining")
            await self.state.set_status(node_id, str(status))
            self.directory.invalidate()  # seen at once by this gateway's next placement
        return plain(await self.nodes.send(request, node))


class GatewayRouter(SandboxRouter):
    """The data plane of a gateway: by sandbox id to its node, whose own router takes it
    from there (so the routing headers go along, and the Host is the client's)."""

    def target_headers(
        self, route: SandboxRoute, scope: Scope, upstream: Upstream
    ) -> list[tuple[bytes, bytes]]:
        headers = [(n, v) for n, v in scope["headers"] if n not in ROUTING_HEADERS]
        return [
            *headers,
            (b"e2b-sandbox-id", route.sandbox_id.encode()),
            (b"e2b-sandbox-port", str(route.port).encode()),
        ]

    def target_path(self, route: SandboxRoute, scope: Scope) -> bytes:
        return scope.get("raw_path") or scope["path"].encode()  # the node strips `/proxy`


def routing_error(e: AenvError) -> str | None:
    """`aenv_gateway_routing_errors_total`'s reason for an error, None when the error is
    the client's (a bad body, a wrong key) rather than the routing's."""
    if isinstance(e, NodeUnreachable):
        return "node_unreachable"
    if isinstance(e, NodeLost):
        return "node_lost"
    if isinstance(e, Unavailable):
        return "no_node"
    if isinstance(e, NotFound):
        return "not_found"
    if isinstance(e, NodeError):
        return "node_error"
    return None


def _upstream(node: NodeRecord) -> Upstream:
    u = urlsplit(node.url)
    return Upstream(u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80))


def create_gateway_app(
    settings: Settings,
    gateway: Gateway,
    directory: Directory,
    lifespan: Lifespan,
    middleware: list[Middleware] | None = None,
) -> ASGIApp:
    """The gateway's one port over its parts (`aenv.server` builds them); `middleware`
    wraps the control plane (the API's request ids: the data plane's answers are the
    sandboxes' own)."""
    control = Starlette(
        middleware=middleware,
        routes=[
            # The web console (static; its API calls come back here with the user's key).
            *console_routes(),
            Route(
                "/{path:path}",
                gateway.handle,
                methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
            ),
        ],
        lifespan=lifespan,
    )

    async def resolve(sandbox_id: str, port: int, token: str | None) -> Upstream:
        try:
            node = await directory.usable(sandbox_id, gateway._release, gateway._adopt, resume=True)
        except NotFound:
            gateway.metrics.routing_error("not_found")
            raise SandboxNotFound(sandbox_id) from None
        except NodeError as e:
            gateway.metrics.routing_error("node_error")
            raise SandboxNotFound(sandbox_id) from e
        except AenvError as e:
            if (reason := routing_error(e)) is not None:
                gateway.metrics.routing_error(reason)
            raise
        return _upstream(node)

    signed_by = SignerLookup(directory, gateway.nodes, settings.api_key)
    return GatewayRouter(control, resolve, settings.routing_domains, signed_by=signed_by)
