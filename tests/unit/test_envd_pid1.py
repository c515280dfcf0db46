"""envd as the bundle runs it: package renamed ``aenv_envd`` and started as PID 1."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers import SRC, free_port, wait_healthy, wait_until

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)"
)


def _run(url: str, cmd: str) -> str:
    msg = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", cmd]}, "stdin": False}).encode()
    r = httpx.post(
        url + "/process.Process/Start",
        content=struct.pack(">BI", 0, len(msg)) + msg,
        headers={"content-type": "application/connect+json"},
        timeout=20,
    )
    out = b""
    data = r.content
    while data:
        _, n = struct.unpack(">BI", data[:5])
        ev = json.loads(data[5 : 5 + n]).get("event", {})
        out += base64.b64decode(ev.get("data", {}).get("stdout", ""))
        data = data[5 + n :]
    return out.decode()


def test_bundle_name_as_pid1(tmp_path: Path) -> None:
    shutil.copytree(SRC / "aenv" / "envd", tmp_path / "aenv_envd")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(tmp_path)
    proc = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            sys.executable,
            "-m",
            "aenv_envd",
        ]
        + ["--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd="/",
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc=proc)
        # PID 1 is the reaper, the server is its child
        assert "aenv_envd" in _run(url, "tr '\\0' ' ' < /proc/1/cmdline")
        assert _run(url, "echo $PPID").strip() != "1"
        # an orphaned grandchild is re-parented to PID 1 and reaped there
        orphan = int(_run(url, "(sleep 0.2 >/dev/null 2>&1 & echo $!)"))
        # Gone from /proc once reaped (a zombie keeps its entry).
        wait_until(
            lambda: "gone" in _run(url, f"test -e /proc/{orphan} || echo gone"),
            10,
            0.05,
            "the orphan to exit and be reaped",
        )
        states = _run(url, "cat /proc/[0-9]*/stat 2>/dev/null | awk '{print $3}'")
        assert "Z" not in states.split()
        # SIGTERM to PID 1 is forwarded; everything exits cleanly
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        os.kill(int(children[0]), signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
