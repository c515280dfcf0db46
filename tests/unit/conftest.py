"""Shared unit-test fixtures: envd on the host, and for the API's tests a started node (the
real orchestrator on the fake runtime, `tests/node_harness.py`) with a client of its app
holding the test key (a module that needs other settings defines its own `node`)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from tests.helpers import SRC, free_port, http_server_thread, wait_healthy
from tests.node_harness import Harness, started
from tests.unit.api_node import API_KEY, api_client
from tests.unit.fake_aenv import API_KEY as CLI_KEY
from tests.unit.fake_aenv import FakeAenv, _Handler


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


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    async for h in started(tmp_path, api_key=API_KEY):
        yield h


@pytest.fixture
async def client(node: Harness) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(node) as c:
        yield c


# The CLI's tests (test_cli.py, test_cli_exec.py): a fake control plane and envd on
# loopback, and the CLI pointed at it.
@pytest.fixture
def fake() -> Iterator[FakeAenv]:
    state = FakeAenv()
    handler = type("Handler", (_Handler,), {"fake": state})
    with http_server_thread(handler) as url:
        state.url = url
        yield state


@pytest.fixture(autouse=True)
def root_logging_kept() -> Iterator[None]:
    """`aenv server` run through a CliRunner sets the root logger's handler to the runner's
    stderr, closed after the invoke: every later log line of the test process would print
    a "Logging error" instead."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def cli(fake: FakeAenv, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> CliRunner:
    monkeypatch.setenv("AENV_URL", fake.url)
    monkeypatch.setenv("AENV_API_KEY", CLI_KEY)
    monkeypatch.setenv("AENV_HOME", str(tmp_path))
    monkeypatch.delenv("AENV_CONFIG_FILE", raising=False)
    # Nothing of the user's own: no saved contexts, no E2B variables, no context chosen.
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for var in ("AENV_CONTEXT", "E2B_API_KEY", "E2B_API_URL", "E2B_DOMAIN"):
        monkeypatch.delenv(var, raising=False)
    return CliRunner()
