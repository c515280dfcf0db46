"""A cluster for integration tests: a real redis-server, real nodes on this host (their
network prefixes and ranges derived from their node ids) over one S3 repository, and gateways,
driven through the stock E2B SDK. One cluster per test module (`run_cluster`): starting the
nodes is the slow part."""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from e2b import Sandbox

from tests import netplan
from tests.helpers import ROOT, RedisServer, free_port, wait_healthy

from .conftest import AENV, Server, running_server

KEY = "e2b_" + "c1" * 20
SECRETS = {
    "redis": f"redis-pw-{uuid.uuid4().hex}",
    "s3": f"s3-secret-{uuid.uuid4().hex}",
    # A `/secrets` value the tests store through the cluster (never to be logged).
    "user secret": f"user-secret-{uuid.uuid4().hex}",
}
# The key every node seals `/secrets` values with (the cluster's, docs/secrets.md).
SECRETS_KEY = base64.b64encode(os.urandom(32)).decode()


def node_ids(tag: str, count: int) -> tuple[str, ...]:
    """This session's node ids for a module's cluster (each node derives its own net prefix
    and range from its id)."""
    return tuple(f"{netplan.name(tag)}-{n}" for n in "abcdefgh"[:count])


@dataclass
class Gateway:
    url: str
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [AENV, "gateway"], env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
        )
        wait_healthy(self.url, 60, proc=self.proc, status=200, log=self.log_path)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self.proc = None

    def sdk(self) -> dict[str, Any]:
        return {"api_key": KEY, "api_url": self.url, "sandbox_url": self.url}

    def get(self, path: str, **params: str) -> httpx.Response:
        return httpx.get(self.url + path, params=params, headers={"X-API-Key": KEY}, timeout=60)


@dataclass
class Cluster:
    redis: RedisServer
    nodes: dict[str, Server]
    gateways: list[Gateway]
    made: list[str] = field(default_factory=list)

    def create(self, gw: Gateway, **kw: Any) -> Sandbox:
        s = Sandbox.create(template="base", timeout=600, **gw.sdk(), **kw)
        self.made.append(s.sandbox_id)
        return s

    def node_of(self, sandbox_id: str) -> str:
        """Which node holds the sandbox, by asking the nodes themselves."""
        for nid, srv in self.nodes.items():
            if srv.proc is None:
                continue
            r = httpx.get(
                f"{srv.url}/sandboxes/{sandbox_id}", headers={"X-API-Key": KEY}, timeout=30
            )
            if r.status_code == 200:
                return nid
        raise AssertionError(f"no live node holds {sandbox_id}")

    def node_status(self, gw: Gateway) -> dict[str, str]:
        return {n["nodeID"]: n["status"] for n in gw.get("/nodes").json()}


@contextlib.contextmanager
def run_cluster(
    s3_endpoint: str, ids: tuple[str, ...], tag: str, gateways: int = 2
) -> Iterator[Cluster]:
    """The nodes `ids` and `gateways` gateways, sharing Redis and a fresh S3 bucket; the
    gateways' logs are kept under AENV_TEST_LOGS, named by `tag`."""
    bucket = f"aenv-{uuid.uuid4().hex[:12]}"
    assert httpx.put(f"{s3_endpoint}/{bucket}", timeout=10).status_code == 200
    work = Path(tempfile.mkdtemp(prefix="aenv-cluster-"))
    # Secrets of their own, so a test can look for them in every log.
    redis = RedisServer(work / "redis", password=SECRETS["redis"])
    redis.start()
    common = dict(
        AENV_REDIS_URL=redis.url,
        AENV_API_KEY=KEY,
        AENV_SECRETS_KEY=SECRETS_KEY,
        AENV_HEARTBEAT_SECONDS="1",
        AENV_NODE_DEAD_AFTER="5",
        AENV_SNAPSHOT_REPO=f"s3://{bucket}/cluster",
        AENV_S3_ENDPOINT=s3_endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY=SECRETS["s3"],
        AWS_DEFAULT_REGION="us-east-1",
    )
    started: list[Gateway] = []
    # Redis goes last: the nodes heartbeat into it until they stop.
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)  # after everything that writes into it
        stack.callback(redis.stop)
        try:
            nodes = {
                nid: stack.enter_context(
                    running_server(
                        nid.replace("-", ""),
                        None,  # prefix and range: derived from the node id
                        AENV_NODE_ID=nid,
                        AENV_HIBERNATE_AFTER="0",
                        AENV_MAX_MEMORY_MB="6144",
                        **common,
                    )
                )
                for nid in ids
            }
            for i in range(gateways):
                port = free_port()
                env = {**os.environ, **common, "AENV_LISTEN": f"127.0.0.1:{port}"}
                gw = Gateway(f"http://127.0.0.1:{port}", env, work / f"gateway-{i}.log")
                gw.start()
                started.append(gw)
            yield Cluster(redis, nodes, started)
        finally:
            for gw in started:
                gw.stop()
            logs = Path(os.environ.get("AENV_TEST_LOGS", "/tmp/aenv-test-logs"))
            with contextlib.suppress(OSError):
                logs.mkdir(parents=True, exist_ok=True)
                for f in work.glob("gateway-*.log"):
                    (logs / f"{netplan.name(tag)}-{f.name}").write_bytes(f.read_bytes())
