"""Filesystem snapshots, fork of a paused sandbox, `GET /snapshots/{id}` and the strict pause,
with the stock E2B Python SDK against real gVisor sandboxes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from e2b import Sandbox, ServiceBusyException

from aenv.runtime.freezer import Freezer
from tests.helpers import wait_until

from .conftest import Server
from .helpers import sandbox_record
from .test_snapshots import counter, rising, start_counter

pytestmark = pytest.mark.integration


def tier(server: Server, sandbox_id: str) -> str | None:
    return (sandbox_record(server.home, sandbox_id)["paused"] or {}).get("tier")


@contextlib.contextmanager
def guest_hung(server: Server, sandbox_id: str) -> Iterator[None]:
    """The sandbox's guest stops answering (every process of its container frozen from the
    host, behind the node's back) until the block ends."""
    cid = sandbox_record(server.home, sandbox_id)["instance"]["id"]
    cgroup = f"/{server.env['AENV_NET_PREFIX']}/{cid}"
    freezer = Freezer()
    freezer.freeze(cgroup)
    try:
        yield
    finally:
        freezer.thaw(cgroup)


def test_filesystem_snapshot_keeps_files_not_processes(
    e2b_env: Server, sandboxes: list[object]
) -> None:
    s = Sandbox.create(template="base", timeout=120, envs={"FROM_SOURCE": "yes"})
    sandboxes.append(s)
    s.files.write("/home/user/fs.txt", "in the snapshot")
    s.commands.run("echo tmp > /tmp/t.txt && mkdir -p /home/user/d && echo x > /home/user/d/x")
    s.commands.run("sleep 999", background=True)
    snap = s.create_snapshot(mode="filesystem")
    # The source goes on, processes and all, and its later writes are its own.
    assert "sleep 999" in s.commands.run("ps aux").stdout
    s.files.write("/home/user/after.txt", "not in the snapshot")
    s.files.remove("/home/user/d")

    with e2b_env.client() as c:
        info = c.get(f"/snapshots/{snap.snapshot_id}")
        assert info.status_code == 200, info.text
        assert info.json()["mode"] == "filesystem"
        assert info.json()["sandboxID"] == s.sandbox_id
        listed = c.get("/snapshots", params={"sandboxID": s.sandbox_id}).json()
        assert [x["mode"] for x in listed if x["snapshotID"] == snap.snapshot_id] == ["filesystem"]
        missing = c.get("/snapshots/no-such-snapshot")
        assert missing.status_code == 404 and missing.json()["code"] == 404
        assert "no-such-snapshot" in missing.json()["message"]

    child = Sandbox.create(template=snap.snapshot_id, timeout=60)
    sandboxes.append(child)
    assert child.files.read("/home/user/fs.txt") == "in the snapshot"
    assert child.files.read("/tmp/t.txt") == "tmp\n"
    assert child.files.read("/home/user/d/x") == "x\n"
    assert not child.files.exists("/home/user/after.txt")
    assert "sleep 999" not in child.commands.run("ps aux").stdout  # booted fresh
    assert child.commands.run("echo $FROM_SOURCE").stdout == "yes\n"
    assert Sandbox.delete_snapshot(snap.snapshot_id)


def test_fork_of_paused_parents(e2b_env: Server, sandboxes: list[object]) -> None:
    frozen = Sandbox.create(template="base", timeout=120)
    hibernated = Sandbox.create(template="base", timeout=120)
    files_only = Sandbox.create(template="base", timeout=120)
    sandboxes += [frozen, hibernated, files_only]
    for p in (frozen, hibernated):
        start_counter(p)
        p.files.write("/home/user/shared.txt", f"from {p.sandbox_id}")
    files_only.files.write("/home/user/shared.txt", "files only")
    files_only.commands.run("sleep 999", background=True)
    at_pause = {}
    for p in (hibernated, frozen):  # the first one hibernates while the other is forked
        at_pause[p.sandbox_id] = counter(p)
        assert p.pause()
    assert files_only.pause(mode="filesystem")

    def check_children(parent: Sandbox, count: int) -> None:
        kids = parent.fork(count=count)
        children = [k for k in kids if isinstance(k, Sandbox)]
        sandboxes.extend(children)
        assert len(children) == count, kids
        for k in children:
            assert k.get_info().state.value == "running"
            assert k.files.read("/home/user/shared.txt") == f"from {parent.sandbox_id}"
            v = counter(k)
            assert v >= at_pause[parent.sandbox_id]
            rising(k, v)  # continues from where the parent was paused
        assert Sandbox.get_info(parent.sandbox_id).state.value == "paused"

    check_children(frozen, 2)
    assert tier(e2b_env, frozen.sandbox_id) == "frozen"

    # AENV_HIBERNATE_AFTER=5 s on the test server.
    wait_until(lambda: tier(e2b_env, hibernated.sandbox_id) == "hibernated", 30, 0.3, "hibernation")
    check_children(hibernated, 1)
    assert tier(e2b_env, hibernated.sandbox_id) == "hibernated"

    (kid,) = files_only.fork(count=1)
    assert isinstance(kid, Sandbox), kid
    sandboxes.append(kid)
    assert kid.files.read("/home/user/shared.txt") == "files only"
    assert "sleep 999" not in kid.commands.run("ps aux").stdout
    assert tier(e2b_env, files_only.sandbox_id) == "files"

    # The parents come back as they were paused.
    again = Sandbox.connect(frozen.sandbox_id)
    rising(again, counter(again))
    assert Sandbox.connect(files_only.sandbox_id).files.read("/home/user/shared.txt") == (
        "files only"
    )


def test_strict_pause_refuses_a_hung_guest(e2b_env: Server, sandboxes: list[object]) -> None:
    s = Sandbox.create(template="base", timeout=120)
    sandboxes.append(s)
    with guest_hung(e2b_env, s.sandbox_id), pytest.raises(ServiceBusyException):
        s.pause(strict=True)
    # Refused, not paused: it keeps running.
    assert s.get_info().state.value == "running"
    assert s.commands.run("echo alive").stdout == "alive\n"
    assert s.pause(strict=True) is True
    assert s.get_info().state.value == "paused"
    assert s.pause(strict=True) is False  # already paused
