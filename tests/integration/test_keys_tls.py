"""A real node on HTTPS with named keys: the stock E2B SDK runs a sandbox with a key made by
`aenv keys create`, and the key is refused once revoked, without a restart.

The test CA is trusted through SSL_CERT_FILE (a bundle of the public CAs plus the test's),
which httpx and the SDK's rustls transport both read; the server gets it too, harmlessly.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import certifi
import httpx
import pytest

from tests import netplan
from tests.integration.conftest import AENV, Server, running_server
from tests.tls import TlsFiles, make_certs

pytestmark = pytest.mark.integration

_SDK = """
import sys
from e2b import Sandbox
from e2b.exceptions import AuthenticationException
try:
    s = Sandbox.create(template="base", timeout=60)
except AuthenticationException:
    print("401")
    sys.exit(0)
try:
    print(s.commands.run("echo over-tls").stdout.strip())
finally:
    s.kill()
"""


@pytest.fixture(scope="module")
def tls() -> Iterator[TlsFiles]:
    with tempfile.TemporaryDirectory(prefix="aenv-tls-") as d:
        yield make_certs(Path(d))


@pytest.fixture(scope="module")
def node(tls: TlsFiles) -> Iterator[Server]:
    bundle = tls.ca.with_name("bundle.pem")
    bundle.write_text(Path(certifi.where()).read_text() + tls.ca.read_text())
    mp = pytest.MonkeyPatch()
    mp.setenv("SSL_CERT_FILE", str(bundle))  # for wait_healthy and Server.client()
    try:
        with running_server(
            *netplan.slot_net("tls").astuple(),
            AENV_TLS_CERT=str(tls.cert),
            AENV_TLS_KEY=str(tls.key),
            SSL_CERT_FILE=str(bundle),
        ) as srv:
            yield srv
    finally:
        mp.undo()


def _aenv(node: Server, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [AENV, *args], env=node.env, capture_output=True, text=True, timeout=60, check=False
    )


def _sdk(node: Server, key: str) -> str:
    env = dict(node.env, E2B_API_URL=node.url, E2B_SANDBOX_URL=node.url, E2B_API_KEY=key)
    out = subprocess.run(
        [sys.executable, "-c", _SDK], env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_sdk_over_https_with_a_created_key_then_revoked(node: Server) -> None:
    assert node.url.startswith("https://")
    made = _aenv(node, "keys", "create", "sdk")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert _sdk(node, key) == "over-tls"
    # The control plane by both headers, and the CLI on its own host (it trusts AENV_TLS_CERT).
    for headers in ({"X-API-Key": key}, {"Authorization": f"Bearer {key}"}):
        assert httpx.get(f"{node.url}/sandboxes", headers=headers).status_code == 200
    listed = _aenv(node, "--api-key", key, "ls", "-o", "json")  # https from AENV_LISTEN
    assert listed.returncode == 0, listed.stderr

    removed = _aenv(node, "keys", "rm", "sdk")
    assert removed.returncode == 0, removed.stderr
    r = httpx.get(f"{node.url}/sandboxes", headers={"X-API-Key": key})
    assert r.status_code == 401 and r.json()["code"] == 401
    assert _sdk(node, key) == "401"
    # AENV_API_KEY (the harness's) still works.
    assert (
        httpx.get(f"{node.url}/sandboxes", headers={"X-API-Key": node.api_key}).status_code == 200
    )


def test_plain_http_is_not_served(node: Server) -> None:
    with pytest.raises(httpx.HTTPError):
        httpx.get(node.url.replace("https://", "http://") + "/health", timeout=5)
