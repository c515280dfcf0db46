"""The egress proxy's header transforms in process, on loopback (no namespaces): a client
that trusts the node's egress CA talks HTTPS (and HTTP) through `EgressProxies._intercept`
to an echo server with a certificate of a test CA; the requests arrive with the rule's
headers, secrets resolved, and the value is in no log line. The gVisor test
(tests/integration/test_secrets_egress.py) does the same from inside a sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from aenv.egress import EgressPolicy
from aenv.runtime.net import sniff
from aenv.runtime.net.egress_ca import EgressCA
from aenv.runtime.net.egress_proxy import EgressProxies, _SlotProxy
from tests.tls import TlsFiles, make_certs

# The servers the fixtures start run on the tests' own loop.
pytestmark = pytest.mark.asyncio(loop_scope="session")

HOST = "api.upstream.test"
VALUE = "tok-9d1e5b77c0"
SECRETS: dict[tuple[str | None, str], str] = {(None, "api_token"): VALUE}


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers each request (keep-alive) with its method, path, headers and body as JSON."""
    with contextlib.suppress(Exception):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ")
            headers = [line.split(": ", 1) for line in lines[1:] if line]
            fields = {k.lower(): v for k, v in headers}
            body = b""
            if "content-length" in fields:
                body = await reader.readexactly(int(fields["content-length"]))
            elif fields.get("transfer-encoding") == "chunked":
                while (size := int((await reader.readline()).strip(), 16)) > 0:
                    body += await reader.readexactly(size + 2)
                    body = body[:-2]
                await reader.readline()
            out = json.dumps(
                {"method": method, "path": path, "headers": headers, "body": body.decode()}
            ).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(out) + out)
            await writer.drain()
    writer.close()


@pytest.fixture
async def upstream(tmp_path: Path) -> AsyncIterator[tuple[TlsFiles, int, int]]:
    """(test CA files, HTTPS port, HTTP port) of an echo server on 127.0.0.1."""
    certs = make_certs(tmp_path / "up", "upstream", dns_names=(HOST,))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certs.cert, certs.key)
    tls = await asyncio.start_server(_echo, "127.0.0.1", 0, ssl=ctx)
    plain = await asyncio.start_server(_echo, "127.0.0.1", 0)
    yield certs, tls.sockets[0].getsockname()[1], plain.sockets[0].getsockname()[1]
    tls.close()
    plain.close()


async def _proxy(
    ca: EgressCA | None, policy: EgressPolicy, up_port: int, port: int
) -> tuple[asyncio.Server, EgressProxies]:
    """A listener that hands each connection to `_intercept` as the slot proxy would after
    its peek; its upstream connections go to `up_port` on loopback."""
    proxies = EgressProxies("127.0.0.1", list)
    proxies.ca = ca
    proxies.secrets = lambda owner, name: SECRETS.get((owner, name))

    async def connect(_proxy: Any, _ip: str, _port: int) -> socket.socket:
        s = socket.socket()
        s.setblocking(False)
        await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", up_port))
        return s

    proxies._connect = connect  # type: ignore[method-assign,assignment]
    slot = _SlotProxy("/nonexistent", policy)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, name = await proxies._peek(reader, port)
        assert name is not None and name != sniff.MORE
        await proxies._intercept(slot, policy, reader, writer, ("127.0.0.1", port), name, head)

    return await asyncio.start_server(handle, "127.0.0.1", 0), proxies


async def _exchange(port: int, requests: bytes, ctx: ssl.SSLContext | None) -> bytes:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=ctx, server_hostname=HOST if ctx else None
    )
    writer.write(requests)
    await writer.drain()
    out = b""
    with contextlib.suppress(asyncio.TimeoutError, ConnectionError, ssl.SSLError):
        while chunk := await asyncio.wait_for(reader.read(65536), 3):
            out += chunk
            if out.count(b"HTTP/1.1 ") >= requests.count(b" HTTP/1.1\r\n") and out.endswith(b"}"):
                break
    writer.close()
    return out


def _bodies(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(part.split(b"\r\n\r\n", 1)[1]) for part in raw.split(b"HTTP/1.1 ")[1:]]


def _client_ctx(ca: EgressCA) -> ssl.SSLContext:
    return ssl.create_default_context(cadata=ca.pem.decode())


@pytest.fixture
def ca(tmp_path: Path, upstream: tuple[TlsFiles, int, int]) -> EgressCA:
    ca = EgressCA(tmp_path / "egress-ca", upstream[0].ca)
    ca.load()
    return ca


async def test_https_requests_get_the_headers_with_secrets_resolved(
    ca: EgressCA, upstream: tuple[TlsFiles, int, int], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    policy = EgressPolicy(
        rules={HOST: [{"Authorization": "Bearer ${e2b.secrets.API_TOKEN}"}, {"X-Plain": "p"}]}
    ).normalized()
    server, _ = await _proxy(ca, policy, upstream[1], 443)
    port = server.sockets[0].getsockname()[1]
    requests = (
        f"GET /one HTTP/1.1\r\nHost: {HOST}\r\nauthorization: Basic old\r\n\r\n"
        f"POST /two HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 5\r\n\r\nhello"
        f"PUT /three HTTP/1.1\r\nHost: {HOST}\r\nTransfer-Encoding: chunked\r\n\r\n"
        "3\r\nabc\r\n0\r\n\r\n"
    ).encode()
    out = await _exchange(port, requests, _client_ctx(ca))
    server.close()
    got = _bodies(out)
    assert [g["path"] for g in got] == ["/one", "/two", "/three"]
    assert [g["body"] for g in got] == ["", "hello", "abc"]
    for g in got:
        auth = [v for k, v in g["headers"] if k.lower() == "authorization"]
        assert auth == [f"Bearer {VALUE}"]  # the client's own replaced
        assert ["X-Plain", "p"] in g["headers"]
    assert VALUE not in caplog.text
    # Host certificates are minted once and kept.
    assert (ca.dir / "hosts" / f"{HOST}.pem").exists()


async def test_plain_http_gets_the_headers(
    ca: EgressCA, upstream: tuple[TlsFiles, int, int]
) -> None:
    policy = EgressPolicy(rules={HOST: [{"X-Token": "${e2b.secrets.api_token}"}]}).normalized()
    server, _ = await _proxy(ca, policy, upstream[2], 80)
    port = server.sockets[0].getsockname()[1]
    req = f"GET / HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
    got = _bodies(await _exchange(port, req, None))
    server.close()
    assert ["X-Token", VALUE] in got[0]["headers"]


async def test_an_unknown_secret_is_a_502_naming_it(
    ca: EgressCA, upstream: tuple[TlsFiles, int, int]
) -> None:
    policy = EgressPolicy(rules={HOST: [{"X-Token": "${e2b.secrets.gone}"}]}).normalized()
    server, _ = await _proxy(ca, policy, upstream[1], 443)
    port = server.sockets[0].getsockname()[1]
    req = f"GET / HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
    out = await _exchange(port, req, _client_ctx(ca))
    server.close()
    assert out.startswith(b"HTTP/1.1 502 ")
    assert b"'gone' is not defined" in out


async def test_an_upstream_certificate_that_does_not_verify_is_a_502(
    tmp_path: Path, upstream: tuple[TlsFiles, int, int]
) -> None:
    ca = EgressCA(tmp_path / "other-ca")  # the system's CAs only: the test CA is unknown
    ca.load()
    policy = EgressPolicy(rules={HOST: [{"X-A": "b"}]}).normalized()
    server, _ = await _proxy(ca, policy, upstream[1], 443)
    port = server.sockets[0].getsockname()[1]
    req = f"GET / HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
    out = await _exchange(port, req, _client_ctx(ca))
    server.close()
    assert out.startswith(b"HTTP/1.1 502 ")
    assert b"did not verify" in out


async def test_the_ca_is_kept_and_private(tmp_path: Path) -> None:
    ca = EgressCA(tmp_path / "ca")
    ca.load()
    pem = ca.pem
    assert (tmp_path / "ca" / "ca.key").stat().st_mode & 0o777 == 0o600
    again = EgressCA(tmp_path / "ca")
    again.load()
    assert again.pem == pem
    ctx = again.server_context("a.example.test")
    assert again.cached_context("a.example.test") is ctx
    with pytest.raises(ValueError):
        again.server_context("../evil")


async def test_the_nodes_of_a_cluster_make_one_ca(tmp_path: Path) -> None:
    """Two nodes with the cluster's secrets key make CAs with one key and name: a client
    that trusts one node's CA completes TLS with the other node's proxy (a sandbox moved
    between them keeps trusting its egress). Without the key, each node's is its own."""
    seed = os.urandom(32)
    a, b = EgressCA(tmp_path / "a", seed=seed), EgressCA(tmp_path / "b", seed=seed)
    lone = EgressCA(tmp_path / "lone")
    for ca in (a, b, lone):
        ca.load()
    assert a.pem != b.pem  # certificates of their own (serials, times), over one key
    ca_a, ca_lone = (x509.load_pem_x509_certificate(c.pem) for c in (a, lone))
    assert ca_a.public_key() != ca_lone.public_key()

    async def handshake(server: EgressCA, trusted: EgressCA) -> None:
        async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.close()

        srv = await asyncio.start_server(
            answer, "127.0.0.1", 0, ssl=server.server_context("api.moved.test")
        )
        port = srv.sockets[0].getsockname()[1]
        client = ssl.create_default_context(cadata=trusted.pem.decode())
        try:
            _, w = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client, server_hostname="api.moved.test"
            )
            w.close()
        finally:
            srv.close()
            await srv.wait_closed()

    await handshake(b, a)  # b's proxy, a's CA in the sandbox's trust store
    with pytest.raises(ssl.SSLCertVerificationError):
        await handshake(lone, a)
