"""A real aenv server (real gVisor sandboxes) for the integration tests.

Each test session gets its own AENV_HOME, network prefix and address range, so it never
collides with a server a developer runs on the same host. Everything it started is removed
by id at the end, even when tests fail: sandboxes through the API, then whatever is left
through the runtime's own reconcile with nothing to keep.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from aenv.runtime.rootfs import mount_points
from tests import netplan
from tests.helpers import ROOT, free_port, wait_healthy

AENV = str(Path(sys.executable).with_name("aenv"))


# A plain-HTTP registry on loopback that tests may start on this address (test_templates*.py);
# the session's server trusts it. Chosen once, before the server starts.
TEST_REGISTRY = f"127.0.0.1:{free_port()}"


@dataclass
class Server:
    url: str
    api_key: str
    home: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": self.api_key}, timeout=60)

    def start(self) -> None:
        assert self.log_path is not None
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [AENV, "server"], env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
        )
        wait_healthy(self.url, 180, proc=self.proc, log=self.log_path)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill_all_sandboxes(self) -> None:
        with self.client() as c:
            for sbx in c.get("/sandboxes").json():
                c.delete(f"/sandboxes/{sbx['sandboxID']}")


def _wipe_runtime(env: dict[str, str]) -> None:
    """Remove every sandbox (container or VM), netns, veth and mount this session's settings
    own, with the backend the settings name."""
    code = (
        "import asyncio\n"
        "from aenv.config import Settings\n"
        "from aenv.runtime.select import make_runtime\n"
        "async def main():\n"
        "    rt = make_runtime(Settings(net_pool_size=0))\n"
        "    await rt.purge()\n"
        "asyncio.run(main())\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=False, timeout=120)


@contextlib.contextmanager
def running_server(prefix: str, cidr: str | None, **extra: str) -> Iterator[Server]:
    """A real node in a temp AENV_HOME with its own net prefix and address range (`cidr`
    None: both left to the node, which derives them from its AENV_NODE_ID); on exit its
    sandboxes are killed, the server stopped and every host trace removed."""
    if os.geteuid() != 0 or not shutil.which("runsc"):
        pytest.skip("integration tests need root and runsc (run `make test`)")
    home = Path(tempfile.mkdtemp(prefix=f"aenv-{prefix}-"))
    # A test may choose the port itself (a setting that names it, e.g. AENV_DOMAIN).
    port = int(extra["AENV_LISTEN"].rsplit(":", 1)[1]) if "AENV_LISTEN" in extra else free_port()
    # Not the session's SDK settings: the CLI run with this env honours E2B_* over the
    # node's own defaults, so they would point it at the session's server.
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(
        AENV_HOME=str(home),
        AENV_LISTEN=f"127.0.0.1:{port}",
        AENV_API_KEY="e2b_integration_" + os.urandom(8).hex(),
        AENV_NET_POOL_SIZE="2",
    )
    if cidr is not None:
        env.update(AENV_NET_PREFIX=prefix, AENV_NET_CIDR=cidr)
    env.update(extra)
    scheme = "https" if env.get("AENV_TLS_CERT") else "http"
    srv = Server(
        url=f"{scheme}://127.0.0.1:{port}",
        api_key=env["AENV_API_KEY"],
        home=home,
        env=env,
        log_path=home / "server.log",
    )
    try:
        subprocess.run(
            [AENV, "template", "build-base", "--quiet"], env=env, check=True, timeout=900
        )
        srv.start()
        yield srv
    finally:
        with contextlib.suppress(Exception):
            if srv.proc is not None:
                srv.kill_all_sandboxes()
        srv.stop()
        _wipe_runtime(env)
        # Every mount below the home (sandbox disks stay mounted while their sandboxes are
        # hibernated), deepest first: `umount -R` alone does nothing, the home is no mount.
        for mount in mount_points(home):
            subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)
        # The server's log outlives its home, for a failure's post-mortem (CI keeps /tmp).
        logs = Path(os.environ.get("AENV_TEST_LOGS", "/tmp/aenv-test-logs"))
        with contextlib.suppress(OSError):
            logs.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(home / "server.log", logs / f"{prefix}-server.log")
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    with running_server(
        *netplan.slot_net("srv").astuple(),
        # A small node budget, so a test can run into it (fork with partial failure).
        AENV_MAX_MEMORY_MB="12288",
        AENV_HIBERNATE_AFTER="5",
        # Sandboxes that opt into standby go on to disk soon (test_standby.py).
        AENV_STANDBY_DISK_AFTER="20",
        # Small disks, so a test can fill one (test_limits.py).
        AENV_DEFAULT_DISK_MB="2048",
        AENV_INSECURE_REGISTRIES=TEST_REGISTRY,
    ) as srv:
        yield srv


@contextlib.contextmanager
def sdk_pointed_at(server: Server) -> Iterator[Server]:
    """The stock E2B SDKs pointed at `server` through the environment, as a user would;
    what was there before comes back afterwards."""
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    os.environ.update(
        E2B_API_URL=server.url, E2B_SANDBOX_URL=server.url, E2B_API_KEY=server.api_key
    )
    try:
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def e2b_env(server: Server) -> Iterator[Server]:
    with sdk_pointed_at(server):
        yield server


@pytest.fixture
def sandboxes(e2b_env: Server) -> Iterator[list[object]]:
    """Collects SDK sandboxes a test creates and kills them by id afterwards."""
    made: list[object] = []
    yield made
    from e2b import Sandbox

    for sbx in made:
        with contextlib.suppress(Exception):
            Sandbox.kill(sbx.sandbox_id)  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server on a free loopback port, stopped (by its pid) even on failure."""
    pytest.importorskip("moto", reason="moto[server] is a test dependency")
    port = free_port()
    log_path = tmp_path_factory.mktemp("moto") / "moto.log"
    endpoint = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        wait_healthy(endpoint, 30, proc=proc, path="/moto-api/", status=200, log=log_path)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
