"""Network policy through the stock E2B SDK against a real node: egress rules at create and
live (`update_network`), kept across pause and inherited by fork children, private traffic
with its token, and envd's internal routes refused by the data plane. The "internet" is a
namespace of the test's own (`fake_internet`)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox, SandboxNetworkOpts

from .conftest import Server
from .fake_internet import DNS, PORT, A, B, fake_internet

pytestmark = pytest.mark.integration

# From inside the sandbox, with bash's /dev/tcp: the answer of an HTTP GET, or why none came.
PROBE = (
    'timeout 5 bash -c \'exec 3<>/dev/tcp/{ip}/{port} && printf "GET / HTTP/1.0\\r\\n\\r\\n" >&3'
    " && cat <&3' 2>&1 || true"
)


@pytest.fixture(scope="module")
def internet() -> Iterator[None]:
    with fake_internet():
        yield


def reach(sbx: Sandbox) -> dict[str, bool]:
    out = {}
    for ip in (A, B):
        text = sbx.commands.run(PROBE.format(ip=ip, port=PORT)).stdout
        out[ip] = f"ext {ip}" in text
        if not out[ip]:
            assert "refused" in text.lower(), text  # refused at once, not dropped
    return out


def test_rules_at_create_and_live(internet: None, sandboxes: list[object]) -> None:
    closed = Sandbox.create(
        template="base", timeout=120, allow_internet_access=False, network={"allow_out": [A]}
    )
    sandboxes.append(closed)
    assert reach(closed) == {A: True, B: False}
    info = closed.get_info()
    assert info.sandbox_id == closed.sandbox_id

    sbx = Sandbox.create(template="base", timeout=120)
    sandboxes.append(sbx)
    assert reach(sbx) == {A: True, B: True}
    sbx.update_network({"deny_out": [B]})
    assert reach(sbx) == {A: True, B: False}
    sbx.update_network({"allow_out": [B], "deny_out": ["0.0.0.0/0"]})  # allow wins
    assert reach(sbx) == {A: False, B: True}
    sbx.update_network({})  # omitted fields are cleared
    assert reach(sbx) == {A: True, B: True}


def test_rules_survive_pause_and_fork(
    internet: None, e2b_env: Server, sandboxes: list[object]
) -> None:
    sbx = Sandbox.create(template="base", timeout=120, network={"deny_out": [A]})
    sandboxes.append(sbx)
    assert sbx.pause()
    again = Sandbox.connect(sbx.sandbox_id)
    assert reach(again) == {A: False, B: True}
    with e2b_env.client() as c:
        r = c.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1})
    assert r.status_code == 201, r.text
    child_id = r.json()[0]["sandbox"]["sandboxID"]
    child = Sandbox.connect(child_id)
    sandboxes.append(child)
    assert reach(child) == {A: False, B: True}


# Domain rules, E2B's typical use: everything denied but some names (HTTP by Host, HTTPS
# by SNI). allowed.test and denied.test share an address; the DNS server is opened by the
# rules, and the sandbox points its own resolv.conf at it (E2B leaves that file alone).
ONLY_NAMES: SandboxNetworkOpts = {
    "allow_out": ["allowed.test", "*.wild.test"],
    "deny_out": ["0.0.0.0/0"],
    "dns_servers": [DNS],
}
URLS = (
    "http://allowed.test/",
    "https://allowed.test/",
    "http://denied.test/",
    "https://denied.test/",
    "https://x.wild.test/",
)


def by_name(sbx: Sandbox) -> dict[str, bool]:
    """Which URLs answer, by curl (resolving through the fake internet's DNS)."""
    sbx.commands.run(f"echo 'nameserver {DNS}' > /etc/resolv.conf", user="root")
    cmd = "; ".join(f'echo "{u} $(curl -sk -m 5 {u})"' for u in URLS)
    out = sbx.commands.run(cmd).stdout.splitlines()
    got = {}
    for url, line in zip(URLS, out, strict=True):
        scheme, host = url.split("://")[0], url.split("/")[2]
        body = line.split(" ", 1)[1].strip() if " " in line else ""
        got[url] = bool(body)
        if body:  # the name arrived as sent, at the address DNS gave
            assert body.split() == [scheme, NAMES_IP[host], host], line
    return got


NAMES_IP = {"allowed.test": A, "denied.test": A, "x.wild.test": B}
ONLY_ALLOWED = {u: "denied" not in u for u in URLS}
EVERY_NAME = dict.fromkeys(URLS, True)


def test_domain_rules_at_create_and_live(internet: None, sandboxes: list[object]) -> None:
    sbx = Sandbox.create(template="base", timeout=120, network=ONLY_NAMES)
    sandboxes.append(sbx)
    assert by_name(sbx) == ONLY_ALLOWED
    assert reach(sbx) == {A: False, B: False}  # other ports: the address rules only
    sbx.update_network(
        {"allow_out": ["denied.test"], "deny_out": ["0.0.0.0/0"], "dns_servers": [DNS]}
    )
    assert by_name(sbx) == {u: "denied.test" in u for u in URLS}
    sbx.update_network({})
    assert by_name(sbx) == EVERY_NAME


def test_domain_rules_survive_pause_and_fork(
    internet: None, e2b_env: Server, sandboxes: list[object]
) -> None:
    sbx = Sandbox.create(template="base", timeout=120, network=ONLY_NAMES)
    sandboxes.append(sbx)
    assert by_name(sbx) == ONLY_ALLOWED
    assert sbx.pause()
    again = Sandbox.connect(sbx.sandbox_id)
    assert by_name(again) == ONLY_ALLOWED
    with e2b_env.client() as c:
        r = c.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1})
    assert r.status_code == 201, r.text
    child = Sandbox.connect(r.json()[0]["sandbox"]["sandboxID"])
    sandboxes.append(child)
    assert by_name(child) == ONLY_ALLOWED
    # A server killed and started again: the running child keeps its rules (the proxy
    # that serves its names is the server's own and comes back with it).
    e2b_env.stop(signal.SIGKILL)
    e2b_env.start()
    assert by_name(Sandbox.connect(child.sandbox_id)) == ONLY_ALLOWED


def test_private_traffic_and_internal_routes(e2b_env: Server, sandboxes: list[object]) -> None:
    sbx = Sandbox.create(template="base", timeout=120, network={"allow_public_traffic": False})
    sandboxes.append(sbx)
    public = Sandbox.create(template="base", timeout=120)
    sandboxes.append(public)
    token = sbx.traffic_access_token
    assert token and not public.traffic_access_token
    sbx.commands.run("python3 -m http.server 3000 >/dev/null 2>&1", background=True)
    route = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": "3000"}
    with httpx.Client(base_url=e2b_env.url, timeout=10) as c:
        deadline = time.monotonic() + 20
        while True:
            r = c.get("/", headers={**route, "e2b-traffic-access-token": token})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        r = c.get("/", headers=route)
        assert r.status_code == 403 and r.json()["code"] == 403
        r = c.get("/", headers={**route, "e2b-traffic-access-token": "wrong"})
        assert r.status_code == 403
        # envd keeps its own token: the SDK still works without the traffic token.
        assert sbx.commands.run("echo ok").stdout == "ok\n"
        # envd's internal routes are not reachable from outside.
        r = c.post("/init", headers={"e2b-sandbox-id": sbx.sandbox_id}, json={})
        assert r.status_code == 403
