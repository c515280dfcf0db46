"""Standby on a real node: a sandbox created with `standbyAfter` naps, then is frozen once it
did nothing for that long; it still shows as running, and any request (a command) thaws it
at once. A sandbox whose background job keeps working is never frozen: its job keeps
counting. One in standby long enough goes on to disk (no container left), still running to
its user, and its next command restores it whole: files and processes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from e2b import Sandbox

from tests.helpers import wait_until

from .conftest import Server

pytestmark = pytest.mark.integration

FREEZER = Path("/sys/fs/cgroup/freezer")
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 1; done"


def frozen(sandbox_id: str) -> bool:
    states = [p.read_text().strip() for p in FREEZER.glob(f"*/{sandbox_id}-*/freezer.state")]
    assert states, f"no freezer cgroup for {sandbox_id}"
    return states[0] != "THAWED"


def on_disk(sandbox_id: str) -> bool:
    return not list(FREEZER.glob(f"*/{sandbox_id}-*/freezer.state"))


def create(server: Server, **body: object) -> Sandbox:
    with server.client() as c:
        r = c.post("/sandboxes", json={"templateID": "base", "timeout": 300, **body})
    assert r.status_code == 201, r.text
    return Sandbox.connect(r.json()["sandboxID"])


def test_standby_freezes_an_idle_sandbox_and_a_command_thaws_it(
    server: Server, sandboxes: list[object]
) -> None:
    s = create(server, standbyAfter=1)
    sandboxes.append(s)
    wait_until(lambda: frozen(s.sandbox_id), 60, 0.5, "the idle sandbox to go to standby")
    with server.client() as c:
        info = c.get(f"/sandboxes/{s.sandbox_id}").json()
    assert info["state"] == "running"
    assert frozen(s.sandbox_id)  # reading its info does not wake it
    # Thawed by the request itself (the command would time out waiting for anything else).
    assert s.commands.run("echo awake", timeout=5).stdout.strip() == "awake"
    assert not frozen(s.sandbox_id)


def test_a_sandbox_whose_job_works_is_never_frozen(server: Server, sandboxes: list[object]) -> None:
    s = create(server, standbyAfter=1)
    sandboxes.append(s)
    s.commands.run(COUNTER, background=True)
    wait_until(lambda: s.files.exists("/tmp/count"), 15, 0.2, "the counter to start")
    start = int(s.files.read("/tmp/count"))
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        assert not frozen(s.sandbox_id)
        time.sleep(1)
    counted = int(s.files.read("/tmp/count"))
    # It kept counting (a napping sandbox's sleeps may end up to a second late).
    assert counted - start >= 10, (start, counted)


def test_a_sandbox_long_in_standby_goes_to_disk_and_a_command_restores_it(
    server: Server, sandboxes: list[object]
) -> None:
    s = create(server, standbyAfter=1)
    sandboxes.append(s)
    s.files.write("/tmp/mark", "kept")
    s.commands.run("sleep 1000", background=True)
    wait_until(lambda: on_disk(s.sandbox_id), 120, 1, "the sandbox in standby to go to disk")
    with server.client() as c:
        info = c.get(f"/sandboxes/{s.sandbox_id}").json()
        listed = [x["sandboxID"] for x in c.get("/v2/sandboxes?state=running").json()]
    assert info["state"] == "running" and s.sandbox_id in listed
    assert on_disk(s.sandbox_id)  # reading its info does not restore it
    out = s.commands.run("cat /tmp/mark; echo; pgrep -x sleep >/dev/null && echo alive").stdout
    assert out.split() == ["kept", "alive"]
    assert not on_disk(s.sandbox_id)
