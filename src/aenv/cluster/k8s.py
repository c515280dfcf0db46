"""Node discovery from the Kubernetes API (`AENV_DISCOVERY=kubernetes`).

The nodes run as a DaemonSet behind a headless Service (`deploy/kubernetes/base/`); Kubernetes
keeps that Service's EndpointSlices current (one endpoint per node pod, its pod IP, the
Kubernetes node it runs on, and whether its readiness probe passes). A gateway lists them
with its own service account (the Role in `deploy/kubernetes/base/rbac.yaml`), so it knows every
node's address even before the node has registered in Redis; the node's `AENV_NODE_ID` is
the Kubernetes node name (`spec.nodeName`), which the endpoint carries as `nodeName`, so the
two views join on it.

`endpoints_from_slices` is the pure part (the list document to `DiscoveredNode`s);
`KubernetesDiscovery` lists the slices from the in-cluster API and watches them from the
list's version (`endpoints.EndpointWatch` keeps the gateway's set current with both).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from aenv.errors import AenvError

SERVICEACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_SERVICE = "aenv-node"
# The label the EndpointSlice controller puts on every slice of a Service.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_API_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
# How long one watch runs before the server ends it (and the watcher starts the next).
WATCH_SECONDS = 300


class KubernetesDiscoveryError(AenvError):
    """Nodes cannot be discovered: not in a cluster, no permission, or the API failed."""

    status = 503


@dataclass(frozen=True)
class DiscoveredNode:
    url: str  # how a gateway reaches the node: http(s)://address:port
    node_name: str | None  # the Kubernetes node the pod runs on (= the aenv node id)
    ready: bool  # the pod passes its readiness probe and is not terminating


def _pick_port(ports: Any, port_name: str | None) -> tuple[int, str] | None:
    """(port, scheme) of the slice's port named `port_name` (any name: the first numbered
    one), or None when the slice has none to offer."""
    if not isinstance(ports, list):
        return None
    for p in ports:
        if not isinstance(p, dict):
            continue
        number = p.get("port")
        # A nil port means "all ports": nothing a URL can be built from.
        if not isinstance(number, int) or isinstance(number, bool) or not 0 < number < 65536:
            continue
        name = p.get("name") or ""
        if port_name is not None and name != port_name:
            continue
        https = str(p.get("appProtocol") or "").lower() == "https" or name == "https"
        return number, "https" if https else "http"
    return None


def _host(address: Any, address_type: Any) -> str | None:
    if not isinstance(address, str) or not address:
        return None
    if address_type == "FQDN":
        return address
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if address_type == "IPv6" and ip.version == 6:
        return f"[{ip.compressed}]"
    if address_type == "IPv4" and ip.version == 4:
        return str(ip)
    return None


def _is_ready(conditions: Any) -> bool:
    if not isinstance(conditions, dict):
        conditions = {}
    # The API's reading: an unset `ready` is ready; a terminating endpoint is on its way out
    # (it can still read ready under publishNotReadyAddresses, so it is checked on its own).
    return conditions.get("ready") is not False and conditions.get("terminating") is not True


def endpoints_from_slices(doc: dict[str, Any], port_name: str | None) -> list[DiscoveredNode]:
    """The nodes an `EndpointSliceList` (or one `EndpointSlice`) names, sorted by URL.

    Each endpoint's first address is used (the API calls an endpoint's addresses fungible);
    slices without a usable port (none named `port_name`; with None, none at all) and
    entries of unknown shape are skipped. One endpoint may sit in two slices for a moment
    while the controller moves it: it is reported once, ready if either says so.
    """
    if not isinstance(doc, dict):
        raise KubernetesDiscoveryError("EndpointSlice list: not a JSON object")
    if doc.get("kind") == "EndpointSlice":
        slices: Any = [doc]
    else:
        slices = doc.get("items")
        if slices is None:
            slices = []
        if not isinstance(slices, list):
            raise KubernetesDiscoveryError("EndpointSlice list: `items` is not a list")
    found: dict[str, DiscoveredNode] = {}
    for item in slices:
        if not isinstance(item, dict):
            continue
        picked = _pick_port(item.get("ports"), port_name)
        endpoints = item.get("endpoints")
        if picked is None or not isinstance(endpoints, list):
            continue
        port, scheme = picked
        for ep in endpoints:
            if not isinstance(ep, dict) or not isinstance(ep.get("addresses"), list):
                continue
            addresses = ep["addresses"]
            host = _host(addresses[0] if addresses else None, item.get("addressType"))
            if host is None:
                continue
            node_name = ep.get("nodeName") if isinstance(ep.get("nodeName"), str) else None
            node = DiscoveredNode(
                f"{scheme}://{host}:{port}", node_name, _is_ready(ep.get("conditions"))
            )
            seen = found.get(node.url)
            if seen is not None:
                node = replace(
                    seen, ready=seen.ready or node.ready, node_name=seen.node_name or node_name
                )
            found[node.url] = node
    return [found[url] for url in sorted(found)]


class WatchExpired(KubernetesDiscoveryError):
    """The version to watch from is gone from the API's history (410): list again."""


def _event(line: str) -> tuple[str, dict[str, Any]] | None:
    """One watch event line: (type, object); None for what is not one."""
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("object"), dict):
        return None
    kind, obj = str(doc.get("type")), doc["object"]
    if kind == "ERROR":
        if obj.get("code") == 410:
            raise WatchExpired(f"the watch's version is gone: {obj.get('message', '')}")
        raise KubernetesDiscoveryError(f"the watch failed: {obj.get('message', obj)}")
    return kind, obj


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


class KubernetesDiscovery:
    """Lists the EndpointSlices of the nodes' headless Service from the Kubernetes API.

    In a pod everything comes from the environment Kubernetes gives it: the API at
    `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`, the service account's
    token, CA and namespace under `serviceaccount_dir`. Each argument overrides its part
    (tests point `api_url` at a server of their own). Outside a cluster the constructor
    raises `KubernetesDiscoveryError` saying what is missing.

    The token is read again for every listing: the kubelet rotates projected service-account
    tokens (about hourly) in place, and a token read once would expire under a long-lived
    gateway.
    """

    def __init__(
        self,
        service: str = DEFAULT_SERVICE,
        namespace: str | None = None,
        *,
        port_name: str | None = None,
        api_url: str | None = None,
        serviceaccount_dir: Path = SERVICEACCOUNT_DIR,
        token_file: Path | None = None,
        ca_file: Path | None = None,
        timeout: float = 10.0,
        page_size: int = 500,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        if api_url is None:
            host = env.get("KUBERNETES_SERVICE_HOST")
            port = env.get("KUBERNETES_SERVICE_PORT")
            if not host or not port:
                raise KubernetesDiscoveryError(
                    "AENV_DISCOVERY=kubernetes: not running in a Kubernetes pod "
                    "(KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not set); "
                    "use AENV_DISCOVERY=redis outside a cluster"
                )
            api_url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        self.api_url = api_url.rstrip("/")
        self.service = service
        self.port_name = port_name
        self.page_size = page_size
        self.token_file = token_file or serviceaccount_dir / "token"
        if _read(self.token_file) is None:
            raise KubernetesDiscoveryError(
                f"AENV_DISCOVERY=kubernetes: no service-account token at {self.token_file} "
                "(is automountServiceAccountToken off for this pod?)"
            )
        ns = namespace or _read(serviceaccount_dir / "namespace")
        if not ns:
            raise KubernetesDiscoveryError(
                "AENV_DISCOVERY=kubernetes: no namespace (set AENV_KUBERNETES_NAMESPACE; "
                f"{serviceaccount_dir / 'namespace'} is missing)"
            )
        self.namespace = ns
        verify: ssl.SSLContext | bool = True
        if self.api_url.startswith("https://"):
            ca = ca_file or serviceaccount_dir / "ca.crt"
            if not ca.is_file():
                raise KubernetesDiscoveryError(
                    f"AENV_DISCOVERY=kubernetes: the cluster's CA certificate {ca} is missing"
                )
            verify = ssl.create_default_context(cafile=str(ca))
        self._http = httpx.AsyncClient(
            base_url=self.api_url, verify=verify, timeout=httpx.Timeout(timeout)
        )

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> KubernetesDiscovery:
        """Service and namespace from `AENV_KUBERNETES_SERVICE` / `_NAMESPACE`, the rest
        as in a pod (`overrides` are further constructor arguments)."""
        env = os.environ if environ is None else environ
        return cls(
            service=env.get("AENV_KUBERNETES_SERVICE") or DEFAULT_SERVICE,
            namespace=env.get("AENV_KUBERNETES_NAMESPACE") or None,
            environ=env,
            **overrides,
        )

    async def nodes(self) -> list[DiscoveredNode]:
        """Every endpoint of the Service, ready or not, following the list's pages."""
        items, _version = await self.slices()
        return endpoints_from_slices({"items": items}, self.port_name)

    async def slices(self) -> tuple[list[Any], str]:
        """The Service's EndpointSlices and the list's resourceVersion (to watch from)."""
        items: list[Any] = []
        cont: str | None = None
        while True:
            params = {"labelSelector": self._selector, "limit": str(self.page_size)}
            if cont:
                params["continue"] = cont
            doc = await self._get(self._path, params, await self._token())
            page = doc.get("items")
            if isinstance(page, list):
                items.extend(page)
            meta = doc.get("metadata")
            meta = meta if isinstance(meta, dict) else {}
            cont = meta.get("continue")
            if not cont:
                return items, str(meta.get("resourceVersion") or "")

    async def watch(self, resource_version: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """The changes to the Service's EndpointSlices after `resource_version`, as the API
        pushes them: (ADDED | MODIFIED | DELETED | BOOKMARK, slice). Ends when the server
        ends the watch (it does every few minutes); `WatchExpired` when the version is too
        old to watch from (list again)."""
        params = {
            "labelSelector": self._selector,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(WATCH_SECONDS),
        }
        headers = {"Authorization": f"Bearer {await self._token()}"}
        where = f"Kubernetes API {self.api_url}"
        timeout = httpx.Timeout(self._http.timeout.connect, read=WATCH_SECONDS + 30)
        try:
            async with self._http.stream(
                "GET", self._path, params=params, headers=headers, timeout=timeout
            ) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise KubernetesDiscoveryError(
                        f"{where}: watching EndpointSlices answered {resp.status_code}"
                    )
                async for line in resp.aiter_lines():
                    event = _event(line)
                    if event is not None:
                        yield event
        except httpx.HTTPError as exc:
            raise KubernetesDiscoveryError(f"{where}: {type(exc).__name__}: {exc}") from exc

    @property
    def _path(self) -> str:
        return _API_PATH.format(namespace=self.namespace)

    @property
    def _selector(self) -> str:
        return f"{SERVICE_NAME_LABEL}={self.service}"

    async def _token(self) -> str:
        token = await asyncio.to_thread(_read, self.token_file)
        if token is None:
            raise KubernetesDiscoveryError(f"service-account token {self.token_file} is gone")
        return token

    async def _get(self, path: str, params: dict[str, str], token: str) -> dict[str, Any]:
        where = f"Kubernetes API {self.api_url}"
        try:
            resp = await self._http.get(
                path,
                params=params,
                headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
            )
        except httpx.HTTPError as exc:
            raise KubernetesDiscoveryError(f"{where}: {type(exc).__name__}: {exc}") from exc
        try:
            body: Any = resp.json()
        except ValueError:
            body = None
        if resp.status_code != 200:
            # The API's errors are `Status` objects with a `message`.
            detail = body.get("message") if isinstance(body, dict) else None
            detail = detail or resp.text[:200] or resp.reason_phrase
            hint = ""
            if resp.status_code == 403:
                hint = (
                    f" (the gateway's service account needs list/watch on "
                    f"discovery.k8s.io endpointslices in namespace {self.namespace})"
                )
            raise KubernetesDiscoveryError(
                f"{where}: listing EndpointSlices answered {resp.status_code}: {detail}{hint}"
            )
        if not isinstance(body, dict):
            raise KubernetesDiscoveryError(f"{where}: the EndpointSlice list is not JSON")
        return body

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> KubernetesDiscovery:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
