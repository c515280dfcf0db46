"""Signed file URLs through a gateway. The SDKs make `download_url`/`upload_url` against
`E2B_SANDBOX_URL` — the gateway's address — so the URL names no sandbox, only the signature
its envd token made. The gateway holds no tokens: it asks every healthy node which of its
sandboxes signed (`POST /cluster/signed`, with the cluster's key) and routes the request to
that sandbox as if it had named it."""

from __future__ import annotations

import asyncio
import logging

from .directory import Directory
from .forward import NodeClient, NodeError
from .records import NodeRecord

log = logging.getLogger("aenv.cluster")


class SignerLookup:
    def __init__(self, directory: Directory, nodes: NodeClient, api_key: str | None) -> None:
        self.directory = directory
        self.nodes = nodes
        self.api_key = api_key

    async def __call__(
        self, path: str, op: str, user: str, signature: str, exp: str | None
    ) -> str | None:
        """The sandbox whose token made the signature, None when no node has it (the
        router answers 401, as envd does to a bad signature)."""
        body = {
            "path": path,
            "operation": op,
            "username": user,
            "signature": signature,
            "expiration": exp,
        }
        nodes = await self.directory.healthy()
        answers = await asyncio.gather(*(self._ask(n, body) for n in nodes), return_exceptions=True)
        for node, found in zip(nodes, answers, strict=True):
            if isinstance(found, BaseException):
                log.warning("signed URL lookup on node %s failed: %s", node.node_id, found)
            elif found is not None:
                # The next requests about it (the route's own resolve first) skip Redis.
                self.directory.remember(found, node.node_id)
                return found
        return None

    async def _ask(self, node: NodeRecord, body: dict[str, str | None]) -> str | None:
        try:
            doc = await self.nodes.call(
                node, "POST", "/cluster/signed", api_key=self.api_key, body=body
            )
        except NodeError as e:
            if e.status == 404:
                return None
            raise
        found = doc.get("sandboxID")
        return found if isinstance(found, str) else None
