"""Shared unit-test fixtures."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def envd_launcher() -> Iterator[Callable[..., str]]:
    """Start envd (``python -m aenv.envd``) as a host subprocess; returns its base URL."""
    procs: list[subprocess.Popen[bytes]] = []

    def launch(env: dict[str, str] | None = None) -> str:
        port = free_port()
        full_env = {**os.environ, "PYTHONPATH": str(SRC), **(env or {})}
        p = subprocess.Popen(
            [sys.executable, "-m", "aenv.envd", "--host", "127.0.0.1", "--port", str(port)],
            env=full_env,
            stdout=subprocess.DEVNULL,
        )
        procs.append(p)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 204:
                    return url
            except httpx.TransportError:
                time.sleep(0.02)
        raise RuntimeError("envd did not start")

    yield launch
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
