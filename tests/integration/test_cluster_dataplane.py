"""The data plane through a gateway, on a cluster of its own (two real nodes, one gateway),
with the stock E2B SDK pointed at the gateway: signed file URLs made against the gateway's
address reach the sandbox that signed them, and a sandbox killed mid-stream ends the client's
streams with the SDK's "killed" error, as it does against a node, and resets the client's
connection on the wire."""

from __future__ import annotations

import base64
import json
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

from .cluster_env import Cluster, node_ids, run_cluster
from .helpers import assert_kill_ends_streams

pytestmark = pytest.mark.integration

NODE_IDS = node_ids("cd", 2)


@pytest.fixture(scope="module")
def cluster(s3_endpoint: str) -> Iterator[Cluster]:
    with run_cluster(s3_endpoint, NODE_IDS, "cd", gateways=1) as c:
        yield c


def test_signed_file_urls_through_a_gateway(cluster: Cluster) -> None:
    """`download_url`/`upload_url` of a secured sandbox name no sandbox, only the gateway's
    address: the gateway finds the signer on its node. Each node holds one such sandbox."""
    gw = cluster.gateways[0]
    made = [cluster.create(gw, secure=True) for _ in range(3)]
    assert len({cluster.node_of(s.sandbox_id) for s in made}) == len(NODE_IDS)
    for s in made:
        s.files.write("signed.txt", f"signed by {s.sandbox_id}")
        assert s.download_url("signed.txt", "user", 60).startswith(gw.url)
        with urllib.request.urlopen(s.download_url("signed.txt", "user", 60)) as resp:
            assert resp.read() == f"signed by {s.sandbox_id}".encode()
        req = urllib.request.Request(
            s.upload_url("up.txt", "user"),
            data=b"uploaded",
            headers={"content-type": "application/octet-stream"},
            method="POST",
        )
        with urllib.request.urlopen(req) as resp:
            assert resp.status == 200
        assert s.files.read("up.txt") == "uploaded"
    forged = made[0].download_url("signed.txt", "root", 60)  # another user's signature...
    forged = forged.replace("username=root", "username=user")  # ...for this one
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(forged)
    assert ei.value.code == 401
    assert json.loads(ei.value.read())["message"] == "invalid signature"
    expired = made[1].download_url("signed.txt", "user", use_signature_expiration=-60)
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(expired)  # found by its signature; its envd refuses it
    assert json.loads(ei.value.read()) == {"code": 401, "message": "signature is already expired"}


def test_a_kill_ends_streams_through_a_gateway(cluster: Cluster) -> None:
    """As against a node: a kill ends a running command's and a PTY's streams read through
    the gateway with the SDK's "killed" error (the node resets its stream to the gateway,
    which resets the client's), not a hang nor a malformed-body error."""
    gw = cluster.gateways[0]
    s = cluster.create(gw)
    assert_kill_ends_streams(s, lambda: Sandbox.kill(s.sandbox_id, **gw.sdk()))


def test_a_kill_resets_a_raw_stream_through_a_gateway(cluster: Cluster) -> None:
    """On the wire: a process stream read through the gateway ends with a connection reset
    when its sandbox is killed (the node resets its stream to the gateway, the gateway the
    client's), not a clean close of an unfinished body, which some clients read as a
    malformed response rather than the connection lost."""
    gw = cluster.gateways[0]
    s = cluster.create(gw)
    headers = {
        "content-type": "application/connect+json",
        "connect-protocol-version": "1",
        "e2b-sandbox-id": s.sandbox_id,
        "e2b-sandbox-port": "49983",
        "x-access-token": s._envd_access_token or "",
    }
    msg = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", "echo up; sleep 600"]}})
    body = struct.pack(">BI", 0, len(msg)) + msg.encode()
    got = b""
    with (
        httpx.Client(timeout=httpx.Timeout(10, read=90)) as client,
        client.stream(
            "POST", f"{gw.url}/process.Process/Start", content=body, headers=headers
        ) as r,
    ):
        assert r.status_code == 200
        parts = r.iter_raw()
        while b"up" not in base64_stdout(got):
            got += next(parts)
        assert Sandbox.kill(s.sandbox_id, **gw.sdk())
        with pytest.raises(httpx.ReadError):  # a clean close: httpx.RemoteProtocolError
            for part in parts:
                got += part


def base64_stdout(raw: bytes) -> bytes:
    """The process output in a Connect stream read so far (its `stdout` fields, base64)."""
    out = b""
    while len(raw) >= 5:
        n = struct.unpack(">I", raw[1:5])[0]
        if len(raw) < 5 + n:
            break
        data = json.loads(raw[5 : 5 + n]).get("event", {}).get("data", {})
        out += base64.b64decode(data.get("stdout", ""))
        raw = raw[5 + n :]
    return out
