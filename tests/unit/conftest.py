"""Shared unit-test fixtures."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from tests.helpers import SRC, free_port, wait_healthy


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
        wait_healthy(url, proc=p)
        return url

    yield launch
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
