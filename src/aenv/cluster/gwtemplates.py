"""Templates through a gateway: a build goes to a node the scheduler picks and its names are
bound to that node; a template's requests follow that binding (its files, its tags); a
change or a delete reaches every node, since each node's catalog knows a template it learned
from the repository."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from ..config import Settings
from ..errors import NotFound
from .answers import json_object, plain
from .directory import Directory
from .forward import NodeClient, NodeUnreachable
from .metrics import GatewayMetrics
from .records import NodeRecord
from .scheduler import Placement, Scheduler
from .state import ClusterState


class GatewayTemplates:
    def __init__(
        self,
        settings: Settings,
        state: ClusterState,
        directory: Directory,
        nodes: NodeClient,
        scheduler: Scheduler,
        metrics: GatewayMetrics,
    ) -> None:
        self.settings, self.state, self.directory = settings, state, directory
        self.nodes, self.scheduler, self.metrics = nodes, scheduler, metrics

    async def build_request(self, request: Request) -> Response:
        body = await request.body()
        nodes = await self.directory.schedulable()
        if not nodes:
            self.metrics.placed("build", "no_node")
        node = self.scheduler.place(
            Placement("", self.settings.default_cpu_count, self.settings.default_memory_mb),
            nodes,
        )
        try:
            resp = await self.nodes.send(request, node, body=body)
        except NodeUnreachable:
            self.metrics.placed("build", "failed")
            raise
        self.metrics.placed("build", "placed" if resp.status_code < 400 else "failed")
        template_id = json_object(resp.content).get("templateID")
        if resp.status_code < 400 and isinstance(template_id, str):
            await self.state.bind_template(template_id, node.node_id)
            for name in json_object(body).get("name"), json_object(body).get("alias"):
                if isinstance(name, str) and name:
                    await self.state.bind_template(name, node.node_id)
        return plain(resp)

    async def template(self, request: Request, template_id: str) -> Response:
        node = await self.node_of(template_id)
        if request.method in ("DELETE", "PATCH"):
            # Every node's catalog knows a template it learned from the repository: a
            # change (public, names) or a delete is made on all of them; its node answers.
            body = await request.body()
            first = await self.nodes.send(request, node, body=body)
            others = [n for n in await self.directory.healthy() if n.node_id != node.node_id]
            await asyncio.gather(
                *(self.nodes.send(request, n, body=body) for n in others),
                return_exceptions=True,
            )
            return plain(first)
        return self.nodes.passthrough(request, node)

    async def tags(self, request: Request) -> Response:
        """Tags are assigned (`target`) or removed (`name`) where the template's builds are."""
        body = await request.body()
        doc = json_object(body)
        name = doc.get("target") or doc.get("name")
        node = await (self.node_of(str(name)) if name else self.directory.any_node())
        return plain(await self.nodes.send(request, node, body=body))

    async def node_of(self, template_id: str) -> NodeRecord:
        """The healthy node a template (or a name:tag of it) is bound to, else any node."""
        name = template_id.split(":", 1)[0]
        for key in (template_id, name):
            node_id = await self.state.template_node(key)
            if node_id is not None:
                try:
                    node = await self.directory.node(node_id)
                except NotFound:
                    continue
                if node.healthy:
                    return node
        return await self.directory.any_node()

    async def files_link(self, request: Request, template_id: str, files_hash: str) -> Response:
        node = await self.node_of(template_id)
        await self.state.bind_template(f"files:{files_hash}", node.node_id)
        return self.nodes.passthrough(request, node)

    async def node_of_files(self, files_hash: str) -> NodeRecord:
        return await self.node_of(f"files:{files_hash}")
