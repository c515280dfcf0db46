"""A real Prometheus (Debian's `prometheus`, installed by `make install`) scrapes a real node
and a real gateway through their `AENV_METRICS_LISTEN` listeners, as a cluster's Prometheus
scrapes pods: both targets come up, `aenv_build_info` is there for each, the HTTP request
counters count a request made through the gateway on both, and the gateway sees its node.
The gateway writes JSON log lines only, its access line with the answer's request id."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import netplan
from tests.helpers import ROOT, RedisServer, free_port, redis_server, wait_healthy, wait_until

from .conftest import AENV, Server, running_server

pytestmark = pytest.mark.integration

PROMETHEUS = Path("/usr/bin/prometheus")


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("prom-redis")) as srv:
        yield srv


@pytest.fixture(scope="module")
def node(redis: RedisServer) -> Iterator[Server]:
    with running_server(
        *netplan.slot_net("prm").astuple(),
        AENV_NODE_ID=netplan.name("prm"),
        AENV_REDIS_URL=redis.url,
        AENV_HEARTBEAT_SECONDS="1",
        AENV_METRICS_LISTEN=f"127.0.0.1:{free_port()}",
        # No sandbox is needed here: none booted ahead of demand.
        AENV_SANDBOX_POOL_SIZE="0",
        AENV_BOOT_SNAPSHOTS="false",
    ) as srv:
        yield srv


@contextlib.contextmanager
def process(
    argv: list[str], log_path: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`argv` running, its output in `log_path`; stopped by its pid afterwards (SIGTERM,
    then SIGKILL), however the test ended."""
    with log_path.open("ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)


@pytest.fixture(scope="module")
def gateway(node: Server, redis: RedisServer) -> Iterator[tuple[str, str, Path]]:
    """A gateway over the node's cluster: (its URL, its metrics listener, its log)."""
    work = Path(tempfile.mkdtemp(prefix="aenv-prom-gw-"))
    port, metrics = free_port(), f"127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        "AENV_HOME": str(work / "home"),
        "AENV_LISTEN": f"127.0.0.1:{port}",
        "AENV_REDIS_URL": redis.url,
        "AENV_API_KEY": node.api_key,
        "AENV_METRICS_LISTEN": metrics,
        "AENV_LOG_FORMAT": "json",
        "AENV_ACCESS_LOG": "true",
    }
    url, log_path = f"http://127.0.0.1:{port}", work / "gateway.log"
    try:
        with process([AENV, "gateway"], log_path, env) as proc:
            wait_healthy(url, 60, proc=proc, status=200, log=log_path)
            yield url, metrics, log_path
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def prometheus(node: Server, gateway: tuple[str, str, Path]) -> Iterator[str]:
    """Prometheus scraping the node's and the gateway's metrics listeners every second,
    with a storage directory of its own; its API's base URL."""
    if not PROMETHEUS.exists():
        pytest.skip(f"{PROMETHEUS} is absent: `make install` installs Debian's prometheus")
    work = Path(tempfile.mkdtemp(prefix="aenv-prom-"))
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {"job_name": "aenv-node", "static_configs": [{"targets": [node_metrics(node)]}]},
            {"job_name": "aenv-gateway", "static_configs": [{"targets": [gateway[1]]}]},
        ],
    }
    # JSON is YAML: no YAML writer needed.
    (work / "prometheus.yml").write_text(json.dumps(config))
    argv = [
        str(PROMETHEUS),
        f"--config.file={work / 'prometheus.yml'}",
        f"--storage.tsdb.path={work / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        with process(argv, work / "prometheus.log") as proc:
            wait_healthy(
                url, 60, proc=proc, path="/-/ready", status=200, log=work / "prometheus.log"
            )
            yield url
    finally:
        logs = Path(os.environ.get("AENV_TEST_LOGS", "/tmp/aenv-test-logs"))
        with contextlib.suppress(OSError):
            logs.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(work / "prometheus.log", logs / f"{netplan.name('prm')}-prometheus.log")
        shutil.rmtree(work, ignore_errors=True)


def node_metrics(node: Server) -> str:
    return node.env["AENV_METRICS_LISTEN"]


def query(prom: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def by_job(prom: str, expr: str) -> dict[str, float]:
    return {s["metric"]["job"]: float(s["value"][1]) for s in query(prom, expr)}


JOBS = {"aenv-node", "aenv-gateway"}


def from_both(prom: str, expr: str) -> dict[str, float]:
    """The query's value by job once both jobs have it, else {} (not yet)."""
    found = by_job(prom, expr)
    return found if found.keys() == JOBS else {}


def test_prometheus_scrapes_the_node_and_the_gateway(
    prometheus: str, node: Server, gateway: tuple[str, str, Path]
) -> None:
    builds = wait_until(
        lambda: from_both(prometheus, "aenv_build_info"),
        timeout=60,
        interval=0.5,
        what="aenv_build_info from both targets",
    )
    assert builds == {"aenv-node": 1.0, "aenv-gateway": 1.0}
    up = by_job(prometheus, "up")
    assert up == {"aenv-node": 1.0, "aenv-gateway": 1.0}, up
    assert set(by_job(prometheus, "process_resident_memory_bytes")) == JOBS

    # One request through the gateway: the gateway passes it on to its one node, and each
    # counts it under the route's template.
    url = gateway[0]
    r = httpx.get(f"{url}/sandboxes", headers={"X-API-Key": node.api_key}, timeout=30)
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    expr = 'aenv_http_requests_total{method="GET",route="/sandboxes",status="200"}'
    counted = wait_until(
        lambda: from_both(prometheus, expr),
        timeout=30,
        interval=0.5,
        what=f"{expr} from both targets",
    )
    assert counted["aenv-gateway"] >= 1 and counted["aenv-node"] >= 1

    # The gateway's own families: the node it routes to is ready.
    nodes = by_job(prometheus, 'aenv_gateway_nodes{status="ready"}')
    assert nodes == {"aenv-gateway": 1.0}, nodes

    # Every line the gateway wrote is JSON (uvicorn's and the access log's included), and
    # the access line carries the request id its answer did.
    lines = gateway[2].read_text().splitlines()
    docs = [json.loads(line) for line in lines if line.strip()]
    access = [d for d in docs if d["logger"] == "aenv.access" and d.get("request_id") == rid]
    assert access and "GET /sandboxes 200" in access[0]["message"], docs[-5:]
