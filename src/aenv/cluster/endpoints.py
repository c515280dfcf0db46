"""The nodes Kubernetes lists as ready, kept current off the request path.

A gateway lists the nodes' EndpointSlices once, then watches them from that list's version:
the API pushes every change, so the set is current without a request per routing decision or
a poll. When a watch ends (the API ends each after a few minutes) the next one starts from the
last version seen; when the version is too old, or the API fails, it lists again after a
pause. Meanwhile the last set that came back stays in force: an API-server hiccup is not a
gateway outage. Before the first list answers, `ready()` is None (no filter: the nodes'
Redis registrations alone decide).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from .k8s import KubernetesDiscovery, KubernetesDiscoveryError, WatchExpired, endpoints_from_slices

log = logging.getLogger("aenv.cluster")


class EndpointWatch:
    def __init__(self, k8s: KubernetesDiscovery, *, retry_seconds: float = 2.0) -> None:
        self.k8s = k8s
        self.retry_seconds = retry_seconds
        self._slices: dict[str, dict[str, Any]] = {}
        self._ready: set[str] | None = None
        self._task: asyncio.Task[None] | None = None

    def ready(self) -> set[str] | None:
        """URLs and node names of the ready endpoints (a registration matches by either)."""
        return self._ready

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="aenv-endpoint-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.k8s.aclose()

    async def _run(self) -> None:
        version: str | None = None
        while True:
            try:
                if version is None:
                    items, version = await self.k8s.slices()
                    self._slices = {_name(s): s for s in items if isinstance(s, dict)}
                    self._publish()
                async for kind, obj in self.k8s.watch(version):
                    version = str(obj.get("metadata", {}).get("resourceVersion") or version)
                    if kind == "BOOKMARK":
                        continue
                    if kind == "DELETED":
                        self._slices.pop(_name(obj), None)
                    else:
                        self._slices[_name(obj)] = obj
                    self._publish()
            except WatchExpired:
                version = None  # list again at once: the version fell out of the history
            except KubernetesDiscoveryError as e:
                log.warning("node discovery: %s (keeping the last list)", e)
                version = None
                await asyncio.sleep(self.retry_seconds)

    def _publish(self) -> None:
        try:
            nodes = endpoints_from_slices(
                {"items": list(self._slices.values())}, self.k8s.port_name
            )
        except KubernetesDiscoveryError as e:
            log.warning("node discovery: %s (keeping the last list)", e)
            return
        ready = [n for n in nodes if n.ready]
        self._ready = {n.url for n in ready} | {n.node_name for n in ready if n.node_name}


def _name(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata")
    return str(meta.get("name")) if isinstance(meta, dict) else ""
