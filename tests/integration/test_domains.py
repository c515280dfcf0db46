"""A node with a real domain (AENV_DOMAIN) on HTTPS with a wildcard certificate: the stock
E2B SDK configured with only E2B_DOMAIN and a key (no E2B_API_URL / E2B_SANDBOX_URL) reaches
the API at `api.{domain}` and the sandbox at `{port}-{id}.{domain}`.

The domain is under `localhost`: the SDK's transport (reqwest) resolves every `*.localhost`
name to loopback by itself (glibc here does not, so the test's own requests go through the
same transport). The node's listener is not on 443, so the domain carries its port
(`aenv.localhost:PORT`), which the SDKs keep in the URLs they build. The test CA is trusted
through SSL_CERT_FILE, which rustls reads; the SDK runs in a child process so that no
transport made earlier in the session (without this CA) is reused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import certifi
import pytest

from tests import netplan
from tests.helpers import free_port
from tests.integration.conftest import Server, running_server
from tests.tls import make_certs

pytestmark = pytest.mark.integration

DOMAIN = "aenv.localhost"

# Runs in the child; prints one JSON object of what it saw.
_SDK = r"""
import json, os, time
import httpx
import pyqwest
from pyqwest.httpx import PyqwestTransport
from e2b import Sandbox

out = {}
http = httpx.Client(transport=PyqwestTransport(pyqwest.get_default_sync_transport()), timeout=60)
s = Sandbox.create(
    template="base", timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": True}
)
try:
    out["domain"] = s.sandbox_domain
    out["echo"] = s.commands.run("echo over-domain").stdout.strip()
    s.files.write("/home/user/site/index.html", "served by a user port\n")
    s.commands.run("cd /home/user/site && python3 -m http.server 8080", background=True)
    out["host"] = s.get_host(8080)
    url = f"https://{out['host']}/index.html"
    for _ in range(100):  # until the server is up
        r = http.get(url)
        if r.status_code == 200:
            break
        time.sleep(0.2)
    out["port_status"], out["port_body"] = r.status_code, r.text

    s.files.write("/home/user/signed.txt", "read through a signed URL")
    out["download_url"] = s.download_url("/home/user/signed.txt")
    out["download"] = http.get(out["download_url"]).text
    up = s.upload_url("/home/user/uploaded.txt")
    r = http.post(up, files={"file": ("uploaded.txt", b"written through a signed URL")})
    out["upload_status"] = r.status_code
    out["uploaded"] = s.files.read("/home/user/uploaded.txt")

    s.pause()
    out["paused_state"] = Sandbox.get_info(s.sandbox_id).state.value
    r = http.get(url)  # HTTP traffic wakes a paused sandbox with autoResume
    out["resumed_status"], out["resumed_body"] = r.status_code, r.text
    out["resumed_state"] = Sandbox.get_info(s.sandbox_id).state.value
    out["after_resume"] = s.commands.run("echo still-here").stdout.strip()
finally:
    s.kill()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Server, dict[str, str]]]:
    with tempfile.TemporaryDirectory(prefix="aenv-domain-") as d:
        tls = make_certs(Path(d), "aenv-domain", dns_names=(DOMAIN, f"*.{DOMAIN}"))
        bundle = tls.ca.with_name("bundle.pem")
        bundle.write_text(Path(certifi.where()).read_text() + tls.ca.read_text())
        port = free_port()
        domain = f"{DOMAIN}:{port}"
        mp = pytest.MonkeyPatch()
        mp.setenv("SSL_CERT_FILE", str(bundle))  # the harness's own requests to 127.0.0.1
        try:
            with running_server(
                *netplan.slot_net("dom").astuple(),
                AENV_LISTEN=f"127.0.0.1:{port}",
                AENV_DOMAIN=domain,
                AENV_TLS_CERT=str(tls.cert),
                AENV_TLS_KEY=str(tls.key),
                SSL_CERT_FILE=str(bundle),
            ) as srv:
                env = {
                    k: v
                    for k, v in os.environ.items()
                    if k not in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DEBUG")
                }
                env.update(E2B_DOMAIN=domain, E2B_API_KEY=srv.api_key, SSL_CERT_FILE=str(bundle))
                yield srv, env
        finally:
            mp.undo()


def test_sdk_with_only_a_domain(node: tuple[Server, dict[str, str]]) -> None:
    srv, env = node
    run = subprocess.run(
        [sys.executable, "-c", _SDK], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    domain = env["E2B_DOMAIN"]
    assert out["domain"] == domain  # from the create response
    assert out["echo"] == "over-domain"
    assert out["host"].startswith("8080-") and out["host"].endswith("." + domain)
    assert (out["port_status"], out["port_body"]) == (200, "served by a user port\n")
    assert (
        out["download_url"].startswith("https://49983-")
        and f".{domain}/files?" in out["download_url"]
    )
    assert "signature=" in out["download_url"]
    assert out["download"] == "read through a signed URL"
    assert out["upload_status"] == 200
    assert out["uploaded"] == "written through a signed URL"
    assert out["paused_state"] == "paused"
    assert (out["resumed_status"], out["resumed_body"]) == (200, "served by a user port\n")
    assert out["resumed_state"] == "running"
    assert out["after_resume"] == "still-here"


def test_api_host_is_the_control_plane(node: tuple[Server, dict[str, str]]) -> None:
    """`api.{domain}` and any other name under it that is no sandbox host is the API;
    a sandbox host of an unknown sandbox is the data plane's JSON 404 (not the API's)."""
    srv, env = node
    code = r"""
import json, os
import httpx, pyqwest
from pyqwest.httpx import PyqwestTransport
d = os.environ["E2B_DOMAIN"]
c = httpx.Client(transport=PyqwestTransport(pyqwest.get_default_sync_transport()), timeout=30)
key = {"X-API-Key": os.environ["E2B_API_KEY"]}
api = c.get(f"https://api.{d}/sandboxes", headers=key)
nosuch = c.get(f"https://49983-inosuchsandbox0000.{d}/health")
print(json.dumps([api.status_code, api.json(), nosuch.status_code, nosuch.json()]))
"""
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-4000:]
    api_status, api_body, status, body = json.loads(run.stdout)
    assert api_status == 200 and isinstance(api_body, list)
    assert status in (404, 502) and body["code"] == status
