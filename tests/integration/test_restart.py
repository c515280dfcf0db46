"""kill -9 of the server: running sandboxes are recovered with their files and processes."""

from __future__ import annotations

import signal

import pytest
from e2b import Sandbox, SandboxQuery

from .conftest import Server

pytestmark = pytest.mark.integration


def test_kill9_recovers_running_sandboxes(e2b_env: Server, sandboxes: list[object]) -> None:
    s = Sandbox.create(template="base", timeout=300, metadata={"case": "restart"})
    sandboxes.append(s)
    s.files.write("/home/user/before.txt", "written before the crash")
    s.commands.run("sleep 7777", background=True)
    e2b_env.stop(signal.SIGKILL)
    e2b_env.start()
    again = Sandbox.connect(s.sandbox_id)
    assert again.files.read("/home/user/before.txt") == "written before the crash"
    assert "sleep 7777" in again.commands.run("ps aux").stdout
    listed = Sandbox.list(query=SandboxQuery(metadata={"case": "restart"})).next_items()
    assert [x.sandbox_id for x in listed] == [s.sandbox_id]
