"""Secrets that never enter the sandbox, on a real node with gVisor sandboxes: a sandbox whose
`network.rules` give a host a header transform naming `${e2b.secrets.API_TOKEN}` calls that
host over HTTPS (and HTTP) and the request arrives with the secret's value; the value is in
no file of the sandbox, no environment, no process, nor in the server's log or catalog; and a
host without rules is not intercepted (the sandbox sees the host's own certificate).

The "host" is an echo server in a namespace of this module's own, on this session's second
link (tests/netplan.py), with a certificate of a test CA the node is told to trust upstream
(AENV_EGRESS_CA_BUNDLE). Names are given to curl with `--resolve` (no DNS involved)."""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import netplan
from tests.integration import netns_host
from tests.integration.conftest import Server, running_server
from tests.tls import TlsFiles, make_certs

pytestmark = pytest.mark.integration

HOST = "api.secret.test"  # has rules
OTHER = "plain.secret.test"  # has none
LINK = netplan.link(1)
IP = LINK.peer
VALUE = "aenv-" + secrets.token_hex(12)
# A pattern that matches VALUE but is not VALUE itself: the commands that look for it carry
# only this, so the value never enters the sandbox through the test's own command lines.
PATTERN = VALUE[:-1] + f"[{VALUE[-1]}]"

ECHO = r"""
import json, socket, ssl, sys, threading
cert, key = sys.argv[1], sys.argv[2]
def handle(c, tls):
    try:
        c.settimeout(10)
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(cert, key)
            c = ctx.wrap_socket(c, server_side=True)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = c.recv(4096)
            if not chunk:
                break
            data += chunk
        lines = data.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
        headers = [[k.strip(), v.strip()] for k, _, v in (l.partition(":") for l in lines[1:])]
        body = json.dumps({"tls": tls, "headers": headers}).encode()
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
    except Exception:
        pass
    finally:
        c.close()
def serve(port, tls):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    while True:
        c = s.accept()[0]
        threading.Thread(target=handle, args=(c, tls), daemon=True).start()
threading.Thread(target=serve, args=(80, False), daemon=True).start()
serve(443, True)
"""


@contextlib.contextmanager
def echo_host(certs: TlsFiles) -> Iterator[None]:
    """The echo server on IP (:80 and :443), in its own namespace, removed afterwards."""
    ns, veth = netns_host.names("sx")
    setup = f"""set -e
ip netns add {ns}
ip link add {veth} type veth peer name eth0 netns {ns}
ip addr add {LINK.host}/30 dev {veth}; ip link set {veth} up
ip -n {ns} addr add {IP}/30 dev eth0; ip -n {ns} link set eth0 up; ip -n {ns} link set lo up
"""

    def ready() -> bool:
        r = subprocess.run(
            ["curl", "-s", "--resolve", f"{HOST}:80:{IP}", f"http://{HOST}/"],
            capture_output=True,
        )
        return b'"headers"' in r.stdout

    with netns_host.serving(
        ns, veth, setup, ECHO, [str(certs.cert), str(certs.key)], ready, "the echo host"
    ):
        yield


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Server, TlsFiles]]:
    with tempfile.TemporaryDirectory(prefix="aenv-sec-") as d:
        certs = make_certs(Path(d), "echo-host", dns_names=(HOST, OTHER))
        with (
            echo_host(certs),
            running_server(
                *netplan.slot_net("sec").astuple(), AENV_EGRESS_CA_BUNDLE=str(certs.ca)
            ) as srv,
        ):
            yield srv, certs


def _run(sbx: Any, cmd: str) -> tuple[int, str]:
    from e2b import CommandExitException

    try:
        r = sbx.commands.run(cmd, timeout=180)
        return r.exit_code, r.stdout + r.stderr
    except CommandExitException as e:
        return e.exit_code, e.stdout + e.stderr


def _headers(out: str) -> dict[str, list[str]]:
    doc, _ = json.JSONDecoder().raw_decode(out, out.index('{"tls"'))
    found: dict[str, list[str]] = {}
    for k, v in doc["headers"]:
        found.setdefault(k.lower(), []).append(v)
    return found


def _value_inside(sbx: Any) -> str:
    """Where in the sandbox VALUE is: files (all of /, not /proc and /sys), the environment of
    every process, the command lines; "" when nowhere."""
    cmd = (
        f"grep -r -l -a -D skip -e '{PATTERN}' / --exclude-dir=proc --exclude-dir=sys "
        "2>/dev/null; "
        f"for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do "
        f"tr '\\0' '\\n' < $f 2>/dev/null | grep -q -a -e '{PATTERN}' && echo $f; done; "
        f"env | grep -a -e '{PATTERN}'; true"
    )
    code, out = _run(sbx, cmd)
    assert code == 0, out
    return out.strip()


def test_a_secret_header_reaches_the_host_and_never_the_sandbox(
    node: tuple[Server, TlsFiles],
) -> None:
    from e2b import Sandbox

    srv, _ = node
    with srv.client() as c:
        r = c.post("/secrets", json={"name": "API_TOKEN", "value": VALUE})
        assert r.status_code == 201, r.text
        assert VALUE not in r.text
        # A rule naming a secret that does not exist is refused.
        bad = {"rules": {HOST: [{"transform": {"headers": {"X": "${e2b.secrets.nope}"}}}]}}
        r = c.post("/v2/sandboxes", json={"templateID": "base", "network": bad})
        assert r.status_code == 400 and "nope" in r.json()["message"]

    opts: dict[str, Any] = {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}
    rules = {
        HOST: [
            {"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.API_TOKEN}"}}},
            {"transform": {"headers": {"X-Aenv-Test": "plain"}}},
        ]
    }
    sbx = Sandbox.create("base", timeout=300, network={"rules": rules}, **opts)  # type: ignore[arg-type]
    try:
        assert _value_inside(sbx) == ""

        # HTTPS with curl (the bundle), then Python (SSL_CERT_FILE / the default paths).
        code, out = _run(sbx, f"curl -sS --resolve {HOST}:443:{IP} https://{HOST}/")
        assert code == 0, out
        got = _headers(out)
        assert got["authorization"] == [f"Bearer {VALUE}"]
        assert got["x-aenv-test"] == ["plain"]
        code, out = _run(
            sbx,
            'python3 -c "import urllib.request as u, socket; '
            f"socket.getaddrinfo = lambda *a, **k: [(2, 1, 6, '', ('{IP}', 443))]; "
            f"print(u.urlopen(u.Request('https://{HOST}/', "
            "headers={'Authorization': 'Basic mine'})).read().decode())\"",
        )
        assert code == 0, out
        assert _headers(out)["authorization"] == [f"Bearer {VALUE}"]  # the sandbox's replaced
        # Plain HTTP too.
        code, out = _run(sbx, f"curl -sS --resolve {HOST}:80:{IP} http://{HOST}/")
        assert code == 0, out
        assert _headers(out)["authorization"] == [f"Bearer {VALUE}"]

        # A host without rules: spliced, its own certificate (the test CA's, which the
        # sandbox does not trust), no header added.
        code, out = _run(sbx, f"curl -sSv -k --resolve {OTHER}:443:{IP} https://{OTHER}/")
        assert code == 0, out
        assert "echo-host CA" in out and "aenv egress CA" not in out
        assert "authorization" not in _headers(out)
        code, out = _run(sbx, f"curl -sSv --resolve {HOST}:443:{IP} https://{HOST}/ -o /dev/null")
        assert "aenv egress CA" in out

        # Still nowhere inside (the answers went to stdout, not to a file).
        assert _value_inside(sbx) == ""
        # The search does find it once the sandbox keeps what the host echoed back.
        code, out = _run(sbx, f"curl -sS --resolve {HOST}:443:{IP} https://{HOST}/ -o /tmp/echo")
        assert code == 0, out
        assert _value_inside(sbx) == "/tmp/echo"
    finally:
        sbx.kill()

    # Nor in the server's log or state files.
    assert srv.log_path is not None
    assert VALUE not in srv.log_path.read_text(errors="replace")
    for f in ("catalog.db", "secrets/secrets.json"):
        assert VALUE.encode() not in (srv.home / f).read_bytes(), f
