"""The core flow with the stock npm `e2b` SDK under Node."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import Server

pytestmark = pytest.mark.integration
JS = Path(__file__).resolve().parents[1] / "js"


@pytest.fixture(scope="module")
def node_sdk() -> Path:
    if not shutil.which("node") or not shutil.which("npm"):
        pytest.skip("node and npm are installed by `make install`")
    if not (JS / "node_modules" / "e2b").is_dir():
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=JS,
            check=True,
            timeout=600,
        )
    return JS


def test_js_core_flow(e2b_env: Server, node_sdk: Path) -> None:
    env = dict(os.environ)
    proc = subprocess.run(
        ["node", "core_flow.mjs"],
        cwd=node_sdk,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["state"] == "running"
    assert out["metadata"] == {"suite": "js"}
    assert out["stdout"] == "yes\nuser\n" and out["stderr"] == "e\n"
    assert out["exitError"] == 7
    assert out["read"] == "hello from js" and out["list"] == ["hello.txt"] and out["exists"]
    assert out["listed"] is True and out["killed"] is True
