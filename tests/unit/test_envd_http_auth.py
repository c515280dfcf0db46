"""envd's auth and /init over raw HTTP (httpx): the access token set by /init and required
afterwards, signed file URLs, and env vars /init refuses because they would break every
command.
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.unit.envd_http_wire import STREAM, bash, envelope, output, parse_envelopes, rpc, run

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="envd tests run as root")


# ---- auth and /init -------------------------------------------------------------


def sign(path: str, op: str, user: str, token: str, exp: int | None = None) -> str:
    import hashlib

    raw = f"{path}:{op}:{user}:{token}" + (f":{exp}" if exp is not None else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()


def test_init_token_and_auth(envd_launcher: Callable[..., str], tmp_path: Path) -> None:
    url = envd_launcher({"AENV_ENVD_DEFAULT_USER": "nobody"})
    with httpx.Client(base_url=url, timeout=20) as c:
        # open until a token is set
        assert c.get("/envs").json() == {}
        r = c.post(
            "/init", json={"accessToken": "t1", "envVars": {"A": "1"}, "defaultUser": "root"}
        )
        assert r.status_code == 204
        assert c.get("/health").status_code == 204
        r = c.get("/envs")
        assert r.status_code == 401 and r.json()["code"] == 401
        assert c.get("/envs", headers={"x-access-token": "t1"}).json() == {"A": "1"}
        r = rpc(c, "process.Process/List", {})
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
        r = c.post("/process.Process/Start", content=envelope(bash("true")), headers=STREAM)
        assert parse_envelopes(r.content)[0][1]["error"]["code"] == "unauthenticated"
        events, _ = run(c, bash("echo $A-$USER", envs={"B": "2"}), {"x-access-token": "t1"})
        assert output(events, "stdout") == b"1-root\n"

        # /init with a wrong token is refused; with the current one it replaces it (fork)
        assert c.post("/init", json={"accessToken": "t2"}).status_code == 401
        r = c.post("/init", json={"accessToken": "t2"}, headers={"x-access-token": "t1"})
        assert r.status_code == 204
        assert rpc(c, "process.Process/List", {}, **{"x-access-token": "t1"}).status_code == 401
        assert rpc(c, "process.Process/List", {}, **{"x-access-token": "t2"}).status_code == 200
        # a stale /init (older timestamp) is ignored
        h = {"x-access-token": "t2"}
        assert (
            c.post(
                "/init", json={"timestamp": "2030-01-01T00:00:00.123456789Z"}, headers=h
            ).status_code
            == 204
        )
        c.post("/init", json={"timestamp": "2029-01-01T00:00:00Z", "accessToken": "t3"}, headers=h)
        assert rpc(c, "process.Process/List", {}, **h).status_code == 200

        # /files: token header or signature
        f = tmp_path / "s.txt"
        f.write_text("signed")
        r = c.get("/files", params={"path": str(f)})
        assert r.status_code == 401
        good = sign(str(f), "read", "", "t2")
        assert c.get("/files", params={"path": str(f), "signature": good}).text == "signed"
        bad = sign(str(f), "write", "", "t2")
        assert c.get("/files", params={"path": str(f), "signature": bad}).status_code == 401
        exp = int(time.time()) + 60
        sig = sign(str(f), "read", "root", "t2", exp)
        r = c.get(
            "/files",
            params={
                "path": str(f),
                "username": "root",
                "signature": sig,
                "signature_expiration": exp,
            },
        )
        assert r.text == "signed"
        old = int(time.time()) - 5
        sig = sign(str(f), "read", "", "t2", old)
        r = c.get("/files", params={"path": str(f), "signature": sig, "signature_expiration": old})
        assert r.status_code == 401 and "expired" in r.json()["message"]
        up = tmp_path / "up.txt"
        r = c.post(
            "/files",
            params={"path": str(up), "signature": sign(str(up), "write", "", "t2")},
            content=b"w",
            headers={"content-type": "application/octet-stream"},
        )
        assert r.status_code == 200 and up.read_text() == "w"


@pytest.mark.parametrize(
    "env_vars", [{"A=B": "x"}, {"": "x"}, {"A": "x\0y"}, {"BIG": "x" * (64 << 10)}]
)
def test_init_refuses_env_vars_that_would_break_every_command(
    envd_launcher: Callable[..., str], env_vars: dict[str, str]
) -> None:
    url = envd_launcher()
    with httpx.Client(base_url=url, timeout=20) as c:
        assert c.post("/init", json={"envVars": {"KEEP": "1"}}).status_code == 204
        r = c.post("/init", json={"envVars": env_vars})
        assert r.status_code == 400 and r.json()["code"] == 400
        # Nothing of the refused /init was applied, and commands still run.
        assert c.get("/envs").json() == {"KEEP": "1"}
        events, _ = run(c, bash("echo $KEEP"))
        assert output(events, "stdout") == b"1\n"
