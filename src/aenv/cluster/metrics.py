"""A gateway's own Prometheus registry: its HTTP requests (by the node API's route
templates, so a gateway's and a node's series line up), placements, routing failures,
forwards to nodes and the nodes it sees; its process and build (`aenv.telemetry`).

A gateway's `/metrics` is this, not a node's: each node is scraped by itself."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.routing import compile_path

from ..telemetry import UNMATCHED, HttpMetrics, register_process_and_build
from .records import NodeRecord

log = logging.getLogger("aenv.cluster")

# A forward to a node: its answer read whole (a create, a listing's page) or streamed (a
# PTY's whole life): from milliseconds to minutes.
FORWARD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

# The node API's route templates (`api/routes/`, `builds/`): what the gateway reports a
# request under. tests/unit/test_gateway_metrics.py keeps it equal to the node's routes.
ROUTE_TEMPLATES = (
    "/health",
    "/metrics",
    "/docs",
    "/openapi.json",
    "/nodes",
    "/nodes/{node_id}",
    "/sandboxes",
    "/sandboxes-cold",
    "/sandboxes/metrics",
    "/sandboxes/pause",
    "/sandboxes/timeout",
    "/sandboxes/{sandbox_id}",
    "/sandboxes/{sandbox_id}/connect",
    "/sandboxes/{sandbox_id}/fork",
    "/sandboxes/{sandbox_id}/lineage",
    "/sandboxes/{sandbox_id}/diff",
    "/sandboxes/{sandbox_id}/apply",
    "/sandboxes/{sandbox_id}/rollback",
    "/sandboxes/{sandbox_id}/logs",
    "/sandboxes/{sandbox_id}/metrics",
    "/sandboxes/{sandbox_id}/network",
    "/sandboxes/{sandbox_id}/pause",
    "/sandboxes/{sandbox_id}/refreshes",
    "/sandboxes/{sandbox_id}/resume",
    "/sandboxes/{sandbox_id}/snapshots",
    "/sandboxes/{sandbox_id}/timeout",
    "/v2/sandboxes",
    "/v2/sandboxes/{sandbox_id}/connect",
    "/v2/sandboxes/{sandbox_id}/logs",
    "/snapshots",
    "/snapshots/{snapshot_id:path}",
    "/templates",
    "/v2/templates",
    "/v3/templates",
    "/templates/tags",
    "/templates/aliases/{alias:path}",
    "/build-files/{files_hash}",
    "/templates/{template_id:path}/builds/{build_id}/logs",
    "/templates/{template_id:path}/builds/{build_id}/status",
    "/templates/{template_id:path}/builds/{build_id}",
    "/v2/templates/{template_id:path}/builds/{build_id}",
    "/templates/{template_id:path}/files/{files_hash}",
    "/templates/{template_id:path}/tags",
    "/templates/{template_id:path}/tags/count",
    "/templates/{template_id:path}/tags/exists",
    "/templates/{template_id:path}/tags/groups",
    "/templates/{template_id:path}/tags/{tag}/assignments",
    "/templates/{template_id:path}",
    "/v2/templates/{template_id:path}",
    "/default-templates",
    "/images/pull",
    "/volumes",
    "/volumes/{volume_id}",
    "/volumecontent/{volume_id}/dir",
    "/volumecontent/{volume_id}/file",
    "/volumecontent/{volume_id}/path",
    "/secrets",
    "/secrets/{secret_id}",
    "/events/sandboxes",
    "/events/sandboxes/{sandbox_id}",
    "/events/webhooks",
    "/events/webhooks/{webhook_id}",
    "/events/webhooks/{webhook_id}/deliveries",
    "/events/webhooks/{webhook_id}/stats",
    "/cluster/webhooks/{webhook_id}",
    "/cluster/events",
    "/cluster/sandboxes/{sandbox_id}/adopt",
    "/cluster/sandboxes/{sandbox_id}/release",
    "/cluster/signed",
)


# In the order above: the first that matches wins (a build's status before the template),
# with Starlette's own path syntax (`{x:path}` takes slashes) as the node matches them, and
# reported as Starlette reports the node's (`/templates/{template_id}`).
_MATCHERS = [(regex, fmt) for regex, fmt, _ in map(compile_path, ROUTE_TEMPLATES)]


def route_template(path: str) -> str:
    """The node API's template for `path`; `unmatched` for any other path (bounded: a
    scanner's random paths do not make a series each)."""
    for pattern, template in _MATCHERS:
        if pattern.match(path):
            return template
    return UNMATCHED


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.http = HttpMetrics(r)
        register_process_and_build(r)
        self.placements = Counter(
            "aenv_gateway_placements",
            "Sandbox creates and template builds placed on nodes, by outcome: placed, "
            "turned_down (every node tried was full, draining or lacked the template), "
            "no_node (none ready), failed (another error answer, or the node unreachable)",
            ["kind", "outcome"],
            registry=r,
        )
        self.routing_errors = Counter(
            "aenv_gateway_routing_errors",
            "Requests the gateway could not route or forward, by reason: node_unreachable, "
            "node_lost (the sandbox's node stopped heartbeating), no_node (no healthy node), "
            "not_found (no node holds the sandbox), move_failed, node_error",
            ["reason"],
            registry=r,
        )
        self.forward_duration = Histogram(
            "aenv_gateway_forward_duration_seconds",
            "Requests passed on to nodes, to the end of the node's answer, by mode: "
            "buffered (read whole by the gateway) or streamed",
            ["mode"],
            buckets=FORWARD_BUCKETS,
            registry=r,
        )
        self.nodes = Gauge(
            "aenv_gateway_nodes",
            "Nodes registered in the cluster, by status (ready, draining, unhealthy)",
            ["status"],
            registry=r,
        )
        self.heartbeat_age = Gauge(
            "aenv_gateway_node_heartbeat_age_seconds",
            "Seconds since each registered node's last heartbeat (by Redis's clock)",
            ["node"],
            registry=r,
        )
        self.state_up = Gauge(
            "aenv_gateway_cluster_state_up",
            "1 when the cluster's Redis answered the last scrape's read, else 0",
            registry=r,
        )

    def placed(self, kind: str, outcome: str) -> None:
        self.placements.labels(kind, outcome).inc()

    def routing_error(self, reason: str) -> None:
        self.routing_errors.labels(reason).inc()

    def forwarded(self, mode: str, seconds: float) -> None:
        self.forward_duration.labels(mode).observe(seconds)

    def timer(self, mode: str) -> Callable[[], None]:
        """Call the result when the forward is over."""
        t0 = time.perf_counter()
        return lambda: self.forwarded(mode, time.perf_counter() - t0)

    def see_nodes(self, nodes: list[NodeRecord]) -> None:
        by_status = Tally("unhealthy" if not n.healthy else n.status for n in nodes)
        for status in ("ready", "draining", "unhealthy"):
            self.nodes.labels(status).set(by_status.get(status, 0))
        # Nodes whose registration expired leave the gauge, not a stale series.
        self.heartbeat_age.clear()
        for n in nodes:
            self.heartbeat_age.labels(n.node_id).set(n.seen_ago)

    async def exposition(self, nodes: Callable[[], Awaitable[list[NodeRecord]]]) -> bytes:
        """The text exposition, with the node gauges read from the cluster now."""
        try:
            self.see_nodes(await nodes())
            self.state_up.set(1)
        except Exception as e:  # Redis down: the rest of the gateway's metrics still count
            log.warning("metrics: cannot read the cluster's nodes: %s", e)
            self.state_up.set(0)
        return await asyncio.to_thread(generate_latest, self.registry)
