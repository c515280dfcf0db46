"""The gateway's HTTP client to nodes for the control plane: a request passed on as it came
(streamed both ways, the client's Host and key kept, so URLs a node builds point back at the
gateway and the node authenticates the caller), or a call of the gateway's own."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..errors import AenvError, BadGateway
from ..proxy._common import HOP_BY_HOP, Target
from ..proxy.http import HttpForwarder
from .metrics import GatewayMetrics
from .records import NodeRecord

log = logging.getLogger("aenv.cluster")

# Long operations (a fork of many children, a drain, a template build's upload) take minutes.
TIMEOUT = httpx.Timeout(connect=5.0, read=900.0, write=900.0, pool=10.0)
_DROP = HOP_BY_HOP | {b"content-length", b"host"}


class NodeUnreachable(BadGateway):
    def __init__(self, node: NodeRecord, error: Exception) -> None:
        super().__init__(f"node {node.node_id!r} ({node.url}) is unreachable: {error!r}")
        self.node_id = node.node_id


class NodeError(AenvError):
    """A node's own error answer to a call of the gateway, kept as it was."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(str(body.get("message") or f"node answered {status}"))
        self.status = status
        self.body = body

    def to_json(self) -> dict[str, object]:
        return dict(self.body)


@dataclass(frozen=True, slots=True)
class NodeTarget(Target):
    """A request passed on to a node as it came; a node that takes no connection is a
    node's error, not a sandbox port's."""

    node_id: str = ""
    # Told of each refused connection (the gateway's routing-error counter).
    on_unreachable: Callable[[], None] | None = field(default=None, compare=False)

    def unreachable(self, reason: str) -> dict[str, object]:
        if self.on_unreachable is not None:
            self.on_unreachable()
        return {"code": 502, "message": f"node {self.node_id!r} is unreachable: {reason}"}


class _Passthrough(Response):
    """A response that is the node's own, relayed byte for byte by the proxy's forwarder
    (the request's body is read from the client as it is sent on)."""

    def __init__(
        self, forwarder: HttpForwarder, target: NodeTarget, metrics: GatewayMetrics
    ) -> None:
        self.forwarder = forwarder
        self.target = target
        self.metrics = metrics
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        done = self.metrics.timer("streamed")
        try:
            await self.forwarder.forward(scope, receive, send, self.target)
        finally:
            done()


class NodeClient:
    def __init__(self, metrics: GatewayMetrics | None = None) -> None:
        self.http = httpx.AsyncClient(
            timeout=TIMEOUT, limits=httpx.Limits(max_connections=512), follow_redirects=False
        )
        self.raw = HttpForwarder()
        self.metrics = metrics or GatewayMetrics()

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.raw.aclose()

    def passthrough(self, request: Request, node: NodeRecord) -> Response:
        """The node answers the request, streamed both ways, nothing of it read here (the
        cheapest way; for requests whose body and answer the gateway needs not see)."""
        u = httpx.URL(node.url)
        scope = request.scope
        raw_path: bytes = scope.get("raw_path") or request.url.path.encode()
        return _Passthrough(
            self.raw,
            NodeTarget(
                sandbox_id=f"node:{node.node_id}",
                sandbox_port=u.port or 80,
                host=u.host,
                port=u.port or 80,
                raw_path=raw_path,
                query=scope.get("query_string", b""),
                headers=list(scope["headers"]),
                node_id=node.node_id,
                on_unreachable=lambda: self.metrics.routing_error("node_unreachable"),
            ),
            self.metrics,
        )

    @staticmethod
    def _headers(request: Request) -> list[tuple[bytes, bytes]]:
        out = [(k, v) for k, v in request.headers.raw if k.lower() not in _DROP]
        host = request.headers.get("host")
        if host:
            # The node builds absolute URLs (upload links) from it: they lead back here.
            out.append((b"x-forwarded-host", host.encode("latin-1")))
            out.append((b"host", host.encode("latin-1")))
        return out

    async def send(
        self, request: Request, node: NodeRecord, *, body: bytes | None = None
    ) -> httpx.Response:
        """Passes the request on and reads the whole answer (for answers the gateway reads
        or merges)."""
        url = httpx.URL(node.url + request.url.path, query=request.url.query.encode())
        content = body if body is not None else await request.body()
        done = self.metrics.timer("buffered")
        try:
            return await self.http.request(
                request.method, url, headers=self._headers(request), content=content
            )
        except httpx.TransportError as e:
            raise NodeUnreachable(node, e) from e
        finally:
            done()

    async def fetch(
        self,
        request: Request,
        node: NodeRecord,
        method: str,
        path: str,
        *,
        params: list[tuple[str, str]] | None = None,
        body: bytes = b"",
    ) -> httpx.Response:
        """A request of the gateway's making on the client's behalf (its key and headers),
        to `path` with `params` (a merge that pages through nodes)."""
        url = httpx.URL(node.url + path, params=params)
        try:
            return await self.http.request(
                method, url, headers=self._headers(request), content=body
            )
        except httpx.TransportError as e:
            raise NodeUnreachable(node, e) from e

    async def call(
        self,
        node: NodeRecord,
        method: str,
        path: str,
        *,
        api_key: str | None,
        body: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A call of the gateway's own (moves, drains), with the caller's key."""
        headers = {"x-api-key": api_key} if api_key else {}
        try:
            resp = await self.http.request(
                method, node.url + path, headers=headers, json=body if body is not None else None
            )
        except httpx.TransportError as e:
            raise NodeUnreachable(node, e) from e
        try:
            doc = resp.json()
        except json.JSONDecodeError:
            doc = {"code": resp.status_code, "message": resp.text[:500]}
        if resp.status_code >= 400:
            raise NodeError(resp.status_code, doc if isinstance(doc, dict) else {"message": doc})
        return doc if isinstance(doc, dict) else {"items": doc}
