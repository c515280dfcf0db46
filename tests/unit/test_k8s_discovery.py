"""Kubernetes node discovery: the EndpointSlice parser, and the client against a stand-in
for the API server (HTTPS on loopback with a test CA, like the in-cluster API)."""

from __future__ import annotations

import json
import queue
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate
import pytest

from aenv.cluster.endpoints import EndpointWatch
from aenv.cluster.k8s import (
    DiscoveredNode,
    KubernetesDiscovery,
    KubernetesDiscoveryError,
    endpoints_from_slices,
)
from tests.helpers import async_wait_until
from tests.tls import make_certs

K8S_VERSION = "1.30"


def _slice(
    name: str,
    endpoints: list[dict[str, Any]],
    *,
    ports: list[dict[str, Any]] | None = None,
    address_type: str = "IPv4",
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "aenv-node"}},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}] if ports is None else ports,
    }


def _ep(address: str, node: str | None, **conditions: bool) -> dict[str, Any]:
    ep: dict[str, Any] = {"addresses": [address], "conditions": conditions}
    if node:
        ep["nodeName"] = node
    return ep


def _list(*slices: dict[str, Any], cont: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"resourceVersion": "42"}
    if cont:
        meta["continue"] = cont
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSliceList",
        "metadata": meta,
        "items": list(slices),
    }


def test_fixtures_are_valid_endpoint_slice_lists() -> None:
    # The parser is only as good as the documents it is tested on: they must be what the
    # API can serve.
    doc = _list(
        _slice("a", [_ep("10.0.0.5", "w1", ready=True)]),
        _slice("b", [_ep("fd00::7", "w2", ready=False)], address_type="IPv6"),
    )
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_parses_ready_and_not_ready_endpoints_with_their_nodes() -> None:
    doc = _list(
        _slice(
            "aenv-node-abc",
            [
                _ep("10.0.1.7", "worker-b", ready=True, serving=True, terminating=False),
                _ep("10.0.0.5", "worker-a", ready=False),
                {"addresses": ["10.0.2.9"]},  # no conditions: ready, per the API
            ],
        )
    )
    assert endpoints_from_slices(doc, None) == [
        DiscoveredNode("http://10.0.0.5:8000", "worker-a", False),
        DiscoveredNode("http://10.0.1.7:8000", "worker-b", True),
        DiscoveredNode("http://10.0.2.9:8000", None, True),
    ]


def test_terminating_endpoint_is_not_ready_even_if_published_ready() -> None:
    # publishNotReadyAddresses keeps `ready` true on a pod that is shutting down.
    doc = _list(_slice("s", [_ep("10.0.0.5", "w1", ready=True, terminating=True)]))
    assert endpoints_from_slices(doc, None) == [DiscoveredNode("http://10.0.0.5:8000", "w1", False)]


def test_port_is_chosen_by_name_and_https_by_app_protocol() -> None:
    ports = [
        {"name": "metrics", "port": 9100},
        {"name": "api", "port": 8443, "appProtocol": "https"},
    ]
    doc = _list(_slice("s", [_ep("10.0.0.5", "w1", ready=True)], ports=ports))
    assert endpoints_from_slices(doc, "api") == [
        DiscoveredNode("https://10.0.0.5:8443", "w1", True)
    ]
    # No name asked: the first numbered port.
    assert [n.url for n in endpoints_from_slices(doc, None)] == ["http://10.0.0.5:9100"]
    # A name no port has: nothing to reach, nothing reported.
    assert endpoints_from_slices(doc, "grpc") == []


def test_slice_without_usable_port_is_skipped() -> None:
    doc = _list(
        _slice("none", [_ep("10.0.0.5", "w1", ready=True)], ports=[]),
        _slice("all-ports", [_ep("10.0.0.6", "w2", ready=True)], ports=[{"name": ""}]),
        _slice("ok", [_ep("10.0.0.7", "w3", ready=True)]),
    )
    assert [n.url for n in endpoints_from_slices(doc, None)] == ["http://10.0.0.7:8000"]


def test_ipv6_addresses_are_bracketed_and_fqdn_kept() -> None:
    doc = _list(
        _slice("v6", [_ep("fd00:0:0::7", "w1", ready=True)], address_type="IPv6"),
        _slice("dns", [_ep("node-1.aenv.svc", "w2", ready=True)], address_type="FQDN"),
    )
    assert [n.url for n in endpoints_from_slices(doc, None)] == [
        "http://[fd00::7]:8000",
        "http://node-1.aenv.svc:8000",
    ]


def test_endpoint_in_two_slices_is_reported_once_ready_if_either_says_so() -> None:
    # The controller may list a moving endpoint in an old and a new slice for a moment.
    doc = _list(
        _slice("old", [_ep("10.0.0.5", "w1", ready=False)]),
        _slice("new", [_ep("10.0.0.5", "w1", ready=True)]),
    )
    assert endpoints_from_slices(doc, None) == [DiscoveredNode("http://10.0.0.5:8000", "w1", True)]


def test_malformed_entries_are_skipped_and_a_bad_document_is_an_error() -> None:
    doc = _list(
        _slice(
            "s",
            [
                {"addresses": []},
                {"addresses": ["not-an-ip"]},
                {"conditions": {"ready": True}},
                "junk",  # type: ignore[list-item]
                _ep("10.0.0.8", "w1", ready=True),
            ],
        ),
        "junk",  # type: ignore[arg-type]
    )
    assert [n.url for n in endpoints_from_slices(doc, None)] == ["http://10.0.0.8:8000"]
    assert endpoints_from_slices({"kind": "EndpointSliceList", "items": []}, None) == []
    # One EndpointSlice, not a list, is read as a list of one.
    one = _slice("s", [_ep("10.0.0.9", "w1", ready=True)])
    assert [n.url for n in endpoints_from_slices(one, None)] == ["http://10.0.0.9:8000"]
    with pytest.raises(KubernetesDiscoveryError, match="items"):
        endpoints_from_slices({"items": {"a": 1}}, None)


# --- the client --------------------------------------------------------------------------


@dataclass
class FakeApi:
    """What the stand-in API server answers and what it saw."""

    pages: dict[str, dict[str, Any]] = field(default_factory=dict)  # continue token -> page
    status: int = 200
    requests: list[tuple[str, dict[str, list[str]], str | None]] = field(default_factory=list)
    url: str = ""
    # What each watch request streams, in turn: its events, then the connection closes;
    # with none left, a watch stays open (sending nothing) until the test ends.
    watches: queue.Queue[list[dict[str, Any]]] = field(default_factory=queue.Queue)
    done: threading.Event = field(default_factory=threading.Event)

    def watch_requests(self) -> list[dict[str, list[str]]]:
        return [q for _p, q, _a in list(self.requests) if q.get("watch") == ["1"]]


@pytest.fixture
def fake_api(tmp_path: Path) -> Iterator[tuple[FakeApi, Path]]:
    tls = make_certs(tmp_path / "tls", name="kube-apiserver")
    api = FakeApi()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            query = parse_qs(parts.query)
            api.requests.append((parts.path, query, self.headers.get("Authorization")))
            if query.get("watch") == ["1"] and api.status == 200:
                self.stream_watch()
                return
            if api.status != 200:
                body: dict[str, Any] = {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "message": 'endpointslices.discovery.k8s.io is forbidden: User "x" cannot list',
                    "reason": "Forbidden",
                    "code": api.status,
                }
            else:
                body = api.pages[query.get("continue", [""])[0]]
            data = json.dumps(body).encode()
            self.send_response(api.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def stream_watch(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()  # no length: the stream ends when the connection closes
            try:
                events = api.watches.get_nowait()
            except queue.Empty:
                api.done.wait(30)
                return
            for event in events:
                self.wfile.write(json.dumps(event).encode() + b"\n")
                self.wfile.flush()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls.cert, tls.key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    api.url = f"https://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    # The service account's files, laid out as the kubelet mounts them.
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text("token-1")
    (sa / "namespace").write_text("aenv")
    (sa / "ca.crt").write_bytes(tls.ca.read_bytes())
    try:
        yield api, sa
    finally:
        api.done.set()
        server.shutdown()
        server.server_close()


async def test_client_lists_the_services_slices_with_the_token_across_pages(
    fake_api: tuple[FakeApi, Path],
) -> None:
    api, sa = fake_api
    api.pages = {
        "": _list(_slice("a", [_ep("10.0.0.5", "w1", ready=True)]), cont="page-2"),
        "page-2": _list(_slice("b", [_ep("10.0.0.6", "w2", ready=False)])),
    }
    async with KubernetesDiscovery(api_url=api.url, serviceaccount_dir=sa) as disco:
        assert await disco.nodes() == [
            DiscoveredNode("http://10.0.0.5:8000", "w1", True),
            DiscoveredNode("http://10.0.0.6:8000", "w2", False),
        ]
        # The kubelet rotates the token in place: the next listing sends the new one.
        (sa / "token").write_text("token-2\n")
        await disco.nodes()
    paths = {path for path, _q, _a in api.requests}
    assert paths == {"/apis/discovery.k8s.io/v1/namespaces/aenv/endpointslices"}
    first, second = api.requests[0][1], api.requests[1][1]
    assert first["labelSelector"] == ["kubernetes.io/service-name=aenv-node"]
    assert "continue" not in first and second["continue"] == ["page-2"]
    assert [auth for _p, _q, auth in api.requests] == [
        "Bearer token-1",
        "Bearer token-1",
        "Bearer token-2",
        "Bearer token-2",
    ]


async def test_client_uses_the_given_service_and_namespace(
    fake_api: tuple[FakeApi, Path],
) -> None:
    api, sa = fake_api
    api.pages = {"": _list()}
    # Service and namespace may be given positionally (as the gateway passes its settings).
    async with KubernetesDiscovery(
        "my-nodes", "prod", api_url=api.url, serviceaccount_dir=sa
    ) as disco:
        assert await disco.nodes() == []
    path, query, _auth = api.requests[0]
    assert path == "/apis/discovery.k8s.io/v1/namespaces/prod/endpointslices"
    assert query["labelSelector"] == ["kubernetes.io/service-name=my-nodes"]


async def test_forbidden_names_the_missing_permission(fake_api: tuple[FakeApi, Path]) -> None:
    api, sa = fake_api
    api.status = 403
    async with KubernetesDiscovery(api_url=api.url, serviceaccount_dir=sa) as disco:
        with pytest.raises(KubernetesDiscoveryError) as err:
            await disco.nodes()
    assert "403" in err.value.message and "is forbidden" in err.value.message
    assert "list/watch" in err.value.message and "namespace aenv" in err.value.message


async def test_server_not_signed_by_the_cluster_ca_is_refused(
    fake_api: tuple[FakeApi, Path], tmp_path: Path
) -> None:
    api, sa = fake_api
    other = make_certs(tmp_path / "other", name="someone-else")
    (sa / "ca.crt").write_bytes(other.ca.read_bytes())
    api.pages = {"": _list()}
    async with KubernetesDiscovery(api_url=api.url, serviceaccount_dir=sa) as disco:
        with pytest.raises(
            KubernetesDiscoveryError, match="Kubernetes API .*CERTIFICATE_VERIFY_FAILED"
        ):
            await disco.nodes()
    assert api.requests == []


def test_outside_a_cluster_the_error_says_so(tmp_path: Path) -> None:
    with pytest.raises(KubernetesDiscoveryError, match="not running in a Kubernetes pod"):
        KubernetesDiscovery(environ={}, serviceaccount_dir=tmp_path)
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(KubernetesDiscoveryError, match="no service-account token"):
        KubernetesDiscovery(environ=env, serviceaccount_dir=tmp_path)
    (tmp_path / "token").write_text("t")
    with pytest.raises(KubernetesDiscoveryError, match="AENV_KUBERNETES_NAMESPACE"):
        KubernetesDiscovery(environ=env, serviceaccount_dir=tmp_path)
    (tmp_path / "namespace").write_text("aenv")
    with pytest.raises(KubernetesDiscoveryError, match="CA certificate"):
        KubernetesDiscovery(environ=env, serviceaccount_dir=tmp_path)


async def test_from_env_reads_service_and_namespace_settings(tmp_path: Path) -> None:
    tls = make_certs(tmp_path / "tls")
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("t")
    (sa / "ca.crt").write_bytes(tls.ca.read_bytes())
    env = {
        "KUBERNETES_SERVICE_HOST": "fd00::1",
        "KUBERNETES_SERVICE_PORT": "6443",
        "AENV_KUBERNETES_SERVICE": "nodes",
        "AENV_KUBERNETES_NAMESPACE": "team-a",
    }
    disco = KubernetesDiscovery.from_env(env, serviceaccount_dir=sa)
    try:
        assert (disco.service, disco.namespace) == ("nodes", "team-a")
        assert disco.api_url == "https://[fd00::1]:6443"
    finally:
        await disco.aclose()
    # Unset, the defaults: the Service of deploy/kubernetes and the pod's own namespace.
    (sa / "namespace").write_text("aenv\n")
    env = {k: v for k, v in env.items() if not k.startswith("AENV_")}
    disco = KubernetesDiscovery.from_env(env, serviceaccount_dir=sa)
    try:
        assert (disco.service, disco.namespace) == ("aenv-node", "aenv")
    finally:
        await disco.aclose()


# --- the watch that keeps the gateway's list current -------------------------------------


def _event(kind: str, obj: dict[str, Any], version: str) -> dict[str, Any]:
    return {
        "type": kind,
        "object": {**obj, "metadata": {**obj["metadata"], "resourceVersion": version}},
    }


async def _ready(watch: EndpointWatch, want: set[str] | None) -> None:
    await async_wait_until(lambda: watch.ready() == want, 10, 0.01, f"ready == {want}")


async def test_the_watch_follows_what_the_api_pushes(fake_api: tuple[FakeApi, Path]) -> None:
    api, sa = fake_api
    a = _slice("a", [_ep("10.0.0.5", "w1", ready=True)])
    api.pages = {"": _list(a)}
    b = _slice("b", [_ep("10.0.0.6", "w2", ready=True)])
    api.watches.put([_event("ADDED", b, "43"), _event("BOOKMARK", {"metadata": {}}, "44")])
    api.watches.put([_event("DELETED", a, "45")])
    watch = EndpointWatch(KubernetesDiscovery(api_url=api.url, serviceaccount_dir=sa))
    assert watch.ready() is None  # nothing listed yet: no filter
    await watch.start()
    try:
        await _ready(watch, {"http://10.0.0.6:8000", "w2"})
        await async_wait_until(lambda: len(api.watch_requests()) == 3, 10, 0.01, "a third watch")
    finally:
        await watch.close()
    # One list; each watch goes on from the last version it saw (the bookmark's too).
    lists = [q for _p, q, _a in api.requests if "watch" not in q]
    assert len(lists) == 1
    assert [q["resourceVersion"] for q in api.watch_requests()] == [["42"], ["44"], ["45"]]


async def test_the_last_list_holds_while_the_api_fails(fake_api: tuple[FakeApi, Path]) -> None:
    api, sa = fake_api
    api.pages = {"": _list(_slice("a", [_ep("10.0.0.5", "w1", ready=True)]))}
    gone = {"code": 410, "message": "too old resource version", "reason": "Expired"}
    api.watches.put([{"type": "ERROR", "object": gone}])
    k8s = KubernetesDiscovery(api_url=api.url, serviceaccount_dir=sa)
    watch = EndpointWatch(k8s, retry_seconds=0.01)
    await watch.start()
    try:
        await _ready(watch, {"http://10.0.0.5:8000", "w1"})
        # The expired watch made it list again; then the API server fails every request.
        await async_wait_until(
            lambda: sum("watch" not in q for _p, q, _a in api.requests) >= 2, 10, 0.01, "a relist"
        )
        failing_from = len(api.requests)
        api.status = 503
        api.done.set()  # the open watch ends; every request from now on fails
        await async_wait_until(
            lambda: len(api.requests) >= failing_from + 3, 10, 0.01, "three failed attempts"
        )
        assert watch.ready() == {"http://10.0.0.5:8000", "w1"}
    finally:
        await watch.close()
