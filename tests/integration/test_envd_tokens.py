"""Every sandbox's envd wants its access token (issue 10, part 8), on a real node: a v1 create
without `secure` returns a token and envd refuses calls without it, and the warm pool's
pre-booted sandboxes, which belong to no one yet, refuse `/init` and commands from whoever
reaches their address on the host (their envd starts with a token only the node knows)."""

from __future__ import annotations

import ipaddress
import subprocess
import time

import httpx
import pytest
from e2b import Sandbox

from .conftest import Server
from .helpers import sandbox_address

pytestmark = pytest.mark.integration

ENVD_PORT = 49983


def test_a_v1_create_without_secure_gets_a_token(e2b_env: Server) -> None:
    with e2b_env.client() as c:
        r = c.post("/sandboxes", json={"templateID": "base", "timeout": 120})
        assert r.status_code == 201, r.text
        sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
        try:
            assert token
            route = {"e2b-sandbox-id": sid, "e2b-sandbox-port": str(ENVD_PORT)}
            url = f"{e2b_env.url}/files"
            params = {"path": "/etc/hostname", "username": "user"}
            assert httpx.get(url, params=params, headers=route).status_code == 401
            ok = httpx.get(url, params=params, headers={**route, "X-Access-Token": token})
            assert ok.status_code == 200 and ok.text.strip() == "sandbox"
            # The stock SDK takes the token from the connect response and uses it.
            s = Sandbox.connect(sid)
            assert s.commands.run("echo ok").stdout == "ok\n"
        finally:
            c.delete(f"/sandboxes/{sid}")


def _slot_addresses(prefix: str) -> list[str]:
    """Where the host reaches each of this node's network slots (the router address, the
    host veth's + 1)."""
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        if fields[1].startswith(f"{prefix}h"):
            host = ipaddress.ip_interface(fields[3]).ip
            found.append(str(host + 1))
    return found


def test_pre_booted_sandboxes_refuse_strangers(e2b_env: Server, sandboxes: list[object]) -> None:
    # A user's sandbox (its address is not one of the pool's); the create refills the pool.
    mine = Sandbox.create(template="base", timeout=120)
    sandboxes.append(mine)
    taken = {sandbox_address(e2b_env.home, mine.sandbox_id)}
    prefix = e2b_env.env["AENV_NET_PREFIX"]
    checked: set[str] = set()
    deadline = time.monotonic() + 120
    while not checked and time.monotonic() < deadline:
        for address in set(_slot_addresses(prefix)) - taken:
            base = f"http://{address}:{ENVD_PORT}"
            try:
                health = httpx.get(f"{base}/health", timeout=2)
            except httpx.HTTPError:
                continue  # a slot with no sandbox (yet)
            if health.status_code != 204:
                continue
            # Someone who found the address tries to make the sandbox theirs, or to use it.
            r = httpx.post(f"{base}/init", json={"accessToken": "stolen"}, timeout=5)
            assert r.status_code == 401, (address, r.status_code, r.text)
            params = {"path": "/etc/hostname", "username": "user"}
            r = httpx.get(f"{base}/files", params=params, timeout=5)
            assert r.status_code == 401, (address, r.status_code, r.text)
            checked.add(address)
        time.sleep(0.5)
    assert checked, "no pre-booted sandbox showed up"
    # The pool still serves creates (its sandboxes were not taken over).
    with e2b_env.client() as c:
        r = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        try:
            s = Sandbox.connect(sid)
            assert s.commands.run("echo ok").stdout == "ok\n"
        finally:
            c.delete(f"/sandboxes/{sid}")
