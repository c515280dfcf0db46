"""A server the bench starts itself: the installed `aenv server` in a temporary AENV_HOME with
its own network prefix and address range (never those of a dev server or the integration
tests), on a free port. Stopping it removes every container, slot, mount and cgroup of that
prefix (the runtime's own `purge`), then sweeps what might be left by name."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

NET_PREFIX = "aebench"
NET_CIDR = "10.206.0.0/16"
AENV = str(Path(sys.executable).with_name("aenv"))


def _term_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux `PR_SET_PDEATHSIG`)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_env(
    home: Path, port: int, api_key: str, extra: dict[str, str] | None = None
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AENV_")}
    env.update(
        AENV_HOME=str(home),
        AENV_LISTEN=f"127.0.0.1:{port}",
        AENV_API_KEY=api_key,
        AENV_NET_PREFIX=NET_PREFIX,
        AENV_NET_CIDR=NET_CIDR,
        # Measured nodes build nothing of their own in the background.
        AENV_CODE_INTERPRETER_AUTOBUILD="0",
    )
    if os.environ.get("AENV_CACHE_DIR"):  # the machine-wide rootfs cache, if moved
        env["AENV_CACHE_DIR"] = os.environ["AENV_CACHE_DIR"]
    env.update(extra or {})
    return env


def build_base(home: Path) -> None:
    """`aenv template build-base --quiet` into `home` (seconds: links the machine cache)."""
    env = bench_env(home, 0, "unused")
    res = subprocess.run(
        [AENV, "template", "build-base", "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if res.returncode != 0:
        raise RuntimeError(f"aenv template build-base failed: {(res.stderr or res.stdout)[-2000:]}")


class BenchServer:
    def __init__(self, home: Path, api_key: str, *, name: str, extra_env: dict[str, str]) -> None:
        self.home = home
        self.api_key = api_key
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = bench_env(home, self.port, api_key, extra_env)
        self.extra_env = dict(extra_env)
        self.log_path = home / f"server-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _spawn(self) -> subprocess.Popen[bytes]:
        with self.log_path.open("ab") as log:
            # Its own session: a Ctrl-C in the terminal reaches only the bench, which then
            # cleans up through the API before stopping the server. If the bench is killed
            # outright, the server gets a SIGTERM (and stops) instead of living on.
            return subprocess.Popen(
                [AENV, "server"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_term_with_parent,
            )

    async def start(self, timeout: float = 90.0) -> None:
        self.proc = self._spawn()
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"aenv server ({self.name}) exited:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/health", timeout=1)).status_code < 300:
                        return
                await asyncio.sleep(0.1)
        raise RuntimeError(
            f"aenv server ({self.name}) did not answer in {timeout:.0f}s:\n{self.log_tail()}"
        )

    async def stop(self) -> None:
        """SIGTERM (the server stops its sandboxes), SIGKILL after 30 s; then the purge."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        await purge(self.env)


async def purge(env: dict[str, str]) -> None:
    """Everything of the bench's prefix and home, through the runtime's own purge (in a
    child process with the server's environment), then a sweep by name of what is left."""
    code = (
        "import asyncio\n"
        "from aenv.config import Settings\n"
        "from aenv.runtime.select import make_runtime\n"
        "asyncio.run(make_runtime(Settings(net_pool_size=0)).purge())\n"
    )
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
        await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            timeout=180,
        )
    await sweep(Path(env["AENV_HOME"]), env["AENV_NET_PREFIX"], env["AENV_NET_CIDR"])


async def sweep(home: Path, prefix: str, cidr: str) -> None:
    """Removes by name what a purge may have missed: runsc containers under the home's state
    root, slots (netns, veths) and iptables chains of `prefix`."""
    from aenv.runtime.gvisor.runsc import Runsc
    from aenv.runtime.net.network import Network, SlotAddressing

    root = home / "runsc"
    if root.is_dir():
        runsc = Runsc("runsc", root)
        with contextlib.suppress(Exception):
            for c in await runsc.list():
                cid = str(c.get("id"))
                pid, _ = runsc.read_pids(cid)
                if pid > 0:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    await runsc.delete(cid)
    net = Network(SlotAddressing(prefix, cidr))
    with contextlib.suppress(Exception):
        await net.cleanup(keep=set())
    with contextlib.suppress(Exception):
        await net.remove_host()


def remove_home(home: Path) -> None:
    """Unmounts whatever is still mounted below `home`, then deletes it."""
    subprocess.run(["umount", "-R", "-l", str(home)], check=False, capture_output=True)
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if line.split()[4].startswith(f"{home}/")]
    for mp in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], check=False, capture_output=True)
    shutil.rmtree(home, ignore_errors=True)
