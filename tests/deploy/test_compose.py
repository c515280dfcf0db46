"""The compose deployment, for real (`make compose-test`; not part of `make test`: it builds
images, minutes the first time). Debian's Docker engine builds the node and gateway images
of deploy/docker/Dockerfile from a debootstrap'd Debian root (there is no Docker Hub here),
and Redis and S3 images the same way; deploy/compose/docker-compose.yml comes up as it is
(only the nodes' debootstrap cache is this host's); the stock E2B SDK creates, runs a
command, forks and pauses sandboxes through a gateway; a node stopped and started again
(`docker-compose stop`, `start`) drains, and its sandboxes go on with their files and
processes."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from aenv.builds.base_rootfs import ensure_cached_rootfs
from aenv.config import Settings
from tests.helpers import ROOT, free_port, wait_until

pytestmark = pytest.mark.skipif(
    os.environ.get("AENV_COMPOSE_TEST") != "1", reason="run by `make compose-test`"
)

HERE = Path(__file__).resolve().parent
COMPOSE_FILE = ROOT / "deploy" / "compose" / "docker-compose.yml"
DOCKER = "/usr/bin/docker"  # Debian's docker.io: engine and client of one release
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BASE = "aenv-compose-test/debian:bookworm"
IMAGES = {
    "node": "aenv-compose-test/node:latest",
    "gateway": "aenv-compose-test/gateway:latest",
    "redis": "aenv-compose-test/redis:latest",
    "s3": "aenv-compose-test/s3:latest",
}


def _run(*args: str, timeout: float = 1800, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(args[:4])}… failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc.stdout


@pytest.fixture(scope="module")
def engine() -> Iterator[None]:
    """Debian's dockerd: the one running, or one started here and stopped at the end."""
    if shutil.which("dockerd") is None or not Path(DOCKER).exists():
        pytest.fail("Debian's docker.io is not installed (make compose-test installs it)")
    started: subprocess.Popen[bytes] | None = None
    if subprocess.run([DOCKER, "info"], capture_output=True, check=False).returncode != 0:
        log = open("/tmp/aenv-compose-test-dockerd.log", "ab")  # noqa: SIM115
        started = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT)
        wait_until(
            lambda: subprocess.run([DOCKER, "info"], capture_output=True).returncode == 0,
            60,
            0.5,
            "dockerd to answer",
        )
    try:
        yield
    finally:
        if started is not None:
            started.terminate()
            started.wait(60)


def _build(target: str | None, dockerfile: Path, tag: str) -> None:
    args = [DOCKER, "build", "--progress=plain", "-f", str(dockerfile), "-t", tag]
    args += ["--build-arg", f"BASE_IMAGE={BASE}"]
    if target is not None:
        args += ["--target", target, "--build-arg", "AENV_VERSION=0.0.0+compose-test"]
    if CA_BUNDLE.is_file():  # this network re-signs TLS: pip and npm must trust its CA
        args += ["--secret", f"id=ca,src={CA_BUNDLE}"]
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    _run(*args, str(ROOT if target is not None else HERE), env=env)


@pytest.fixture(scope="module")
def images(engine: None) -> dict[str, float]:
    """The four images, built as an operator would; seconds each took."""
    rootfs, _meta = ensure_cached_rootfs(Settings())
    took: dict[str, float] = {}
    t0 = time.monotonic()
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run([DOCKER, "import", "-", BASE], stdin=tar.stdout, check=True, capture_output=True)
    assert tar.wait() == 0
    took["base"] = time.monotonic() - t0
    dockerfile = ROOT / "deploy" / "docker" / "Dockerfile"
    for name, target, path in (
        ("node", "node", dockerfile),
        ("gateway", "gateway", dockerfile),
        ("redis", None, HERE / "redis.Dockerfile"),
        ("s3", None, HERE / "s3.Dockerfile"),
    ):
        t0 = time.monotonic()
        _build(target, path, IMAGES[name])
        took[name] = time.monotonic() - t0
    print("image builds (s):", json.dumps({k: round(v, 1) for k, v in took.items()}))
    return took


def _privileged_works() -> bool:
    probe = [DOCKER, "run", "--rm", "--privileged", "--entrypoint", "true", BASE]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


@dataclass
class Deployment:
    project: str
    env: dict[str, str]
    key: str
    gateways: tuple[str, str]
    metrics: dict[str, int]
    overrides: tuple[str, ...] = ("compose.cache.yml",)

    def compose(self, *args: str, timeout: float = 900) -> str:
        files = ["-f", str(COMPOSE_FILE)]
        for name in self.overrides:
            files += ["-f", str(HERE / name)]
        return _run(
            "docker-compose", "-p", self.project, *files, *args, timeout=timeout, env=self.env
        )

    def sdk(self, gateway: int = 0) -> dict[str, Any]:
        url = self.gateways[gateway]
        return {"api_key": self.key, "api_url": url, "sandbox_url": url}

    def nodes(self) -> dict[str, str]:
        try:
            r = httpx.get(f"{self.gateways[0]}/nodes", headers={"X-API-Key": self.key}, timeout=30)
        except httpx.HTTPError:  # the gateway's container is still starting
            return {}
        return {n["nodeID"]: n["status"] for n in r.json()} if r.status_code == 200 else {}

    def holds(self, node: str, sandbox_id: str) -> bool:
        """Whether the node's own API knows the sandbox (asked inside its container)."""
        code = (
            "import sys, urllib.request as u\n"
            f"r = u.Request('http://127.0.0.1:8000/sandboxes/{sandbox_id}', "
            f"headers={{'X-API-Key': '{self.key}'}})\n"
            "try:\n    u.urlopen(r, timeout=20)\nexcept Exception:\n    sys.exit(1)\n"
        )
        proc = subprocess.run(
            [DOCKER, "exec", f"{self.project}_{node}_1", "python3", "-c", code],
            capture_output=True,
            check=False,
            timeout=60,
        )
        return proc.returncode == 0


@pytest.fixture(scope="module")
def deployment(images: dict[str, float]) -> Iterator[Deployment]:
    key = "e2b_" + secrets.token_hex(20)
    ports = (free_port(), free_port())
    metrics = {
        "METRICS_PORT_NODE_1": free_port(),
        "METRICS_PORT_NODE_2": free_port(),
        "METRICS_PORT_GATEWAY_1": free_port(),
        "METRICS_PORT_GATEWAY_2": free_port(),
    }
    env = {
        **os.environ,
        "AENV_IMAGE": IMAGES["node"],
        "AENV_GATEWAY_IMAGE": IMAGES["gateway"],
        "REDIS_IMAGE": IMAGES["redis"],
        "S3_IMAGE": IMAGES["s3"],
        "AENV_API_KEY": key,
        "REDIS_PASSWORD": secrets.token_hex(16),
        "GATEWAY_PORT_1": str(ports[0]),
        "GATEWAY_PORT_2": str(ports[1]),
        **{k: str(v) for k, v in metrics.items()},
    }
    urls = (f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}")
    d = Deployment(f"aenvct{os.getpid()}", env, key, urls, metrics)
    if not _privileged_works():
        print("privileged containers are refused here: the nodes run without CAP_SYS_RESOURCE")
        d.overrides += ("compose.nopriv.yml",)
    t0 = time.monotonic()
    try:
        d.compose("up", "-d")
        wait_until(
            lambda: d.nodes() == {"node-1": "ready", "node-2": "ready"},
            900,
            3,
            "both nodes ready behind the gateway",
        )
        print(f"compose up to two ready nodes: {time.monotonic() - t0:.0f} s")
        yield d
    finally:
        with contextlib.suppress(Exception):
            Path("/tmp/aenv-compose-test.log").write_text(d.compose("logs", "--no-color"))
        d.compose("down", "--volumes", "--remove-orphans", "--timeout", "300")
        if "compose.nopriv.yml" in d.overrides:  # the host's own hierarchy was the nodes'
            for prefix in ("aen1", "aen2"):  # the compose file's AENV_NET_PREFIX of each
                for parent in Path("/sys/fs/cgroup").glob(f"*/{prefix}"):
                    with contextlib.suppress(OSError):
                        parent.rmdir()


def test_the_sdk_works_through_a_gateway(deployment: Deployment) -> None:
    s = Sandbox.create(template="base", timeout=600, **deployment.sdk())
    try:
        assert s.commands.run("echo compose-$((40+2))").stdout.strip() == "compose-42"
        s.files.write("/home/user/f.txt", "in compose")
        kids = s.fork(count=2)
        for k in kids:
            assert isinstance(k, Sandbox), k
            assert k.files.read("/home/user/f.txt") == "in compose"
            k.kill()
        assert s.pause()
        back = Sandbox.connect(s.sandbox_id, **deployment.sdk(1))  # the other gateway
        assert back.files.read("/home/user/f.txt") == "in compose"
    finally:
        s.kill()


def test_a_node_restart_drains_and_its_sandboxes_go_on(deployment: Deployment) -> None:
    made = [Sandbox.create(template="base", timeout=900, **deployment.sdk()) for _ in range(2)]
    try:
        for i, s in enumerate(made):
            s.files.write("/home/user/mine.txt", f"sandbox {i}")
            s.commands.run(f"sleep {8100 + i}", background=True)
        node = next(n for n in ("node-1", "node-2") if deployment.holds(n, made[0].sandbox_id))
        t0 = time.monotonic()
        deployment.compose("stop", "--timeout", "300", node)
        stopped = time.monotonic() - t0
        logs = deployment.compose("logs", "--no-color", node)
        assert f"node {node} drained at stop" in logs, logs[-3000:]
        for i, s in enumerate(made):
            out = s.commands.run("cat /home/user/mine.txt; ps aux").stdout
            assert f"sandbox {i}" in out and f"sleep {8100 + i}" in out
        deployment.compose("start", node)
        wait_until(lambda: deployment.nodes().get(node) == "ready", 600, 3, f"{node} ready again")
        print(f"{node}: stop with drain {stopped:.0f} s, back {time.monotonic() - t0:.0f} s")
        for i, s in enumerate(made):
            assert s.files.read("/home/user/mine.txt") == f"sandbox {i}"
        fresh = Sandbox.create(template="base", timeout=300, **deployment.sdk())
        assert fresh.commands.run("true").exit_code == 0
        fresh.kill()
    finally:
        for s in made:
            with contextlib.suppress(Exception):
                s.kill()


def _query(prom: str, expr: str) -> dict[str, float]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    return {s["metric"].get("job", ""): float(s["value"][1]) for s in r.json()["data"]["result"]}


def test_prometheus_scrapes_the_gateways_and_the_nodes(
    deployment: Deployment, tmp_path: Path
) -> None:
    """Debian's Prometheus, as an operator would point it at the published metrics ports."""
    nodes = [f"127.0.0.1:{p}" for k, p in deployment.metrics.items() if "NODE" in k]
    gateways = [f"127.0.0.1:{p}" for k, p in deployment.metrics.items() if "GATEWAY" in k]
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {"job_name": "aenv-node", "static_configs": [{"targets": nodes}]},
            {"job_name": "aenv-gateway", "static_configs": [{"targets": gateways}]},
        ],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    prom = f"http://127.0.0.1:{port}"
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            "/usr/bin/prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # a request through a gateway, to be counted
        httpx.get(f"{deployment.gateways[0]}/sandboxes", headers={"X-API-Key": deployment.key})

        def counted() -> bool:
            try:
                return _query(prom, "count by (job) (aenv_build_info)") == {
                    "aenv-node": 2.0,
                    "aenv-gateway": 2.0,
                }
            except httpx.HTTPError:
                return False

        wait_until(counted, 90, 1, "Prometheus to see both nodes and both gateways")
        requests = _query(prom, 'sum by (job) (aenv_http_requests_total{route="/sandboxes"})')
        assert requests.get("aenv-gateway", 0) >= 1 and requests.get("aenv-node", 0) >= 1
        assert _query(prom, 'aenv_gateway_nodes{status="ready"}')  # the gateways' own series
    finally:
        proc.terminate()
        proc.wait(30)
