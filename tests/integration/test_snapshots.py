"""Pause/resume, hibernation, snapshots and fork with the stock E2B Python SDK."""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

from tests import netplan
from tests.helpers import wait_until

from .conftest import Server, running_server, sdk_pointed_at
from .helpers import sandbox_record

pytestmark = pytest.mark.integration

COUNTER = """
import time
n = 0
while True:
    n += 1
    with open('/home/user/counter.tmp', 'w') as f:
        f.write(str(n))
    import os; os.replace('/home/user/counter.tmp', '/home/user/counter')
    time.sleep(0.05)
"""


def counter(s: Sandbox) -> int:
    return int(s.files.read("/home/user/counter").strip() or 0)


def rising(s: Sandbox, above: int, timeout: float = 10) -> int:
    """Waits until the sandbox's in-memory counter is past `above`; returns it."""
    return wait_until(
        lambda: (v := counter(s)) > above and v, timeout, 0.1, f"the counter to pass {above}"
    )


def start_counter(s: Sandbox) -> int:
    s.files.write("/home/user/counter.py", COUNTER)
    s.commands.run("python3 /home/user/counter.py", background=True)
    wait_until(lambda: s.files.exists("/home/user/counter"), 10, 0.05, "the counter file")
    return rising(s, 3)


def state(server: Server, sid: str) -> dict[str, object]:
    with server.client() as c:
        return dict(c.get(f"/sandboxes/{sid}").json())


def test_pause_connect_keeps_memory_and_files(e2b_env: Server, sandboxes: list[object]) -> None:
    s = Sandbox.create(template="base", timeout=120)
    sandboxes.append(s)
    start_counter(s)
    s.files.write("/home/user/note.txt", "kept")
    at_pause = counter(s)
    assert s.pause()
    assert s.get_info().state.value == "paused"
    assert not s.pause()  # already paused → 409 → False
    # Paused for a while (10 of the counter's ticks): nothing marks "frozen for some time",
    # and the bound below would catch a counter that went on meanwhile.
    time.sleep(0.5)
    again = Sandbox.connect(s.sandbox_id)
    assert again.files.read("/home/user/note.txt") == "kept"
    v = counter(again)
    assert v >= at_pause and v < at_pause + 15, (at_pause, v)  # continued, not restarted
    rising(again, v)
    assert again.get_info().state.value == "running"


def test_hibernate_then_resume_from_disk(e2b_env: Server, sandboxes: list[object]) -> None:
    s = Sandbox.create(template="base", timeout=120)
    sandboxes.append(s)
    start_counter(s)
    assert s.pause()
    # The server hibernates frozen sandboxes after AENV_HIBERNATE_AFTER=5 s.
    deadline = time.time() + 30
    while (sandbox_record(e2b_env.home, s.sandbox_id)["paused"] or {}).get("tier") != "hibernated":
        assert time.time() < deadline, "the paused sandbox was never hibernated"
        time.sleep(0.5)
    rec = sandbox_record(e2b_env.home, s.sandbox_id)
    assert rec["instance"] is None
    image = str(rec["paused"]["image"])
    # The hibernated sandbox lives in the repository; the node keeps the image only in its
    # bounded cache. Drop that copy too: resuming must fetch it back from the repository.
    manifest = e2b_env.home / "repo" / "manifests" / f"{image}.json"
    deadline = time.time() + 30
    while not manifest.exists() or (e2b_env.home / "images" / image).exists():
        assert time.time() < deadline, "the hibernated sandbox was never published"
        time.sleep(0.2)
    shutil.rmtree(e2b_env.home / "cache" / "images" / image, ignore_errors=True)
    again = Sandbox.connect(s.sandbox_id)
    v = counter(again)
    rising(again, v)
    assert again.commands.run("echo alive").stdout == "alive\n"
    # Resumed: the repository no longer holds it.
    deadline = time.time() + 30
    while manifest.exists():
        assert time.time() < deadline, "the resumed sandbox's hibernation stayed in the repository"
        time.sleep(0.2)


def test_pause_without_memory_keeps_files_only(e2b_env: Server, sandboxes: list[object]) -> None:
    s = Sandbox.create(template="base", timeout=120)
    sandboxes.append(s)
    s.files.write("/home/user/disk.txt", "on disk")
    s.commands.run("sleep 999", background=True)
    with e2b_env.client() as c:
        assert c.post(f"/sandboxes/{s.sandbox_id}/pause", json={"memory": False}).status_code == 204
    again = Sandbox.connect(s.sandbox_id)
    assert again.files.read("/home/user/disk.txt") == "on disk"
    assert "sleep 999" not in again.commands.run("ps aux").stdout


def test_proxy_on_paused_sandbox(e2b_env: Server, sandboxes: list[object]) -> None:
    plain = Sandbox.create(template="base", timeout=120)
    sandboxes.append(plain)
    plain.pause()
    hdr = {"E2b-Sandbox-Id": plain.sandbox_id, "E2b-Sandbox-Port": "49983"}
    r = httpx.get(f"{e2b_env.url}/health", headers=hdr)
    # E2B's edge answer, which the SDK reads as "not running"
    assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"
    assert r.json()["state"] == "paused"
    assert not plain.is_running()
    with e2b_env.client() as c:
        resp = c.post(
            "/v2/sandboxes",
            json={"templateID": "base", "timeout": 120, "autoResume": {"enabled": True}},
        )
        assert resp.status_code == 201
        sid = resp.json()["sandboxID"]
        try:
            assert c.post(f"/sandboxes/{sid}/pause").status_code == 204
            assert c.get(f"/sandboxes/{sid}").json()["lifecycle"]["autoResume"] is True
            r = httpx.get(
                f"{e2b_env.url}/health",
                headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"},
            )
            assert r.status_code == 204
            assert c.get(f"/sandboxes/{sid}").json()["state"] == "running"
        finally:
            c.delete(f"/sandboxes/{sid}")


def test_auto_pause_on_timeout(e2b_env: Server) -> None:
    with e2b_env.client() as c:
        sid = c.post(
            "/sandboxes", json={"templateID": "base", "timeout": 2, "autoPause": True}
        ).json()["sandboxID"]
        try:
            deadline = time.time() + 20
            while c.get(f"/sandboxes/{sid}").json()["state"] != "paused":
                assert time.time() < deadline, "never auto-paused"
                time.sleep(0.5)
            assert c.get(f"/sandboxes/{sid}").json()["lifecycle"]["onTimeout"] == "pause"
            assert c.post(f"/sandboxes/{sid}/connect", json={"timeout": 60}).status_code == 201
        finally:
            c.delete(f"/sandboxes/{sid}")


def test_snapshot_by_id_and_name(e2b_env: Server, sandboxes: list[object]) -> None:
    s = Sandbox.create(template="base", timeout=120)
    sandboxes.append(s)
    start_counter(s)
    s.files.write("/home/user/snap.txt", "in the snapshot")
    name = f"snap-{s.sandbox_id}"
    snap = s.create_snapshot(name=name)
    assert snap.names == [name]
    at_snap = counter(s)
    rising(s, at_snap)  # the source keeps running
    s.files.write("/home/user/after.txt", "not in the snapshot")
    listed = [x.snapshot_id for x in Sandbox.list_snapshots(sandbox_id=s.sandbox_id).next_items()]
    assert snap.snapshot_id in listed
    with e2b_env.client() as http:
        for key in (snap.snapshot_id, name):
            info = http.get(f"/snapshots/{key}").json()
            assert info["snapshotID"] == snap.snapshot_id and info["mode"] == "full"
    for template in (snap.snapshot_id, name):
        c = Sandbox.create(template=template, timeout=60)
        sandboxes.append(c)
        assert c.files.read("/home/user/snap.txt") == "in the snapshot"
        assert not c.files.exists("/home/user/after.txt")
        v = counter(c)
        rising(c, v)
        assert "counter.py" in c.commands.run("ps aux").stdout
    assert Sandbox.delete_snapshot(snap.snapshot_id)
    assert not Sandbox.delete_snapshot(snap.snapshot_id)


def test_fork_children_continue_and_diverge(e2b_env: Server, sandboxes: list[object]) -> None:
    p = Sandbox.create(template="base", timeout=120)
    sandboxes.append(p)
    start_counter(p)
    p.files.write("/home/user/shared.txt", "from the parent")
    at_fork = counter(p)
    kids = p.fork(count=4)
    assert len(kids) == 4
    children = [k for k in kids if isinstance(k, Sandbox)]
    sandboxes.extend(children)
    assert len(children) == 4, kids
    assert len({k.sandbox_id for k in children} | {p.sandbox_id}) == 5
    for i, k in enumerate(children):
        assert k.files.read("/home/user/shared.txt") == "from the parent"
        v = counter(k)
        assert v >= at_fork
        rising(k, v)
        k.files.write("/home/user/mine.txt", f"child {i}")
    for i, k in enumerate(children):
        assert k.files.read("/home/user/mine.txt") == f"child {i}"
    assert not p.files.exists("/home/user/mine.txt")
    rising(p, counter(p))  # the parent continues, same id
    randoms = {k.commands.run("head -c 16 /dev/urandom | od -An -tx1").stdout for k in children}
    assert len(randoms) == 4


def test_fork_reports_partial_failure(e2b_env: Server) -> None:
    # The test server's node budget is 12 GiB: 4 children of 4 GiB cannot all fit.
    with e2b_env.client() as c:
        big = c.post(
            "/v2/sandboxes", json={"templateID": "base", "timeout": 120, "memoryMB": 4096}
        ).json()
        try:
            r = c.post(f"/sandboxes/{big['sandboxID']}/fork", json={"count": 4})
            assert r.status_code == 201
            body = r.json()
            ok = [x["sandbox"]["sandboxID"] for x in body if "sandbox" in x]
            errs = [x["error"] for x in body if "error" in x]
            try:
                assert len(body) == 4 and ok and errs, body
                assert all("memory" in e["message"] for e in errs)
            finally:
                for sid in ok:
                    c.delete(f"/sandboxes/{sid}")
        finally:
            c.delete(f"/sandboxes/{big['sandboxID']}")


@pytest.fixture
def own_server(e2b_env: Server) -> Iterator[Server]:
    """A node of the test's own, for a test that kills its server with -9: on the shared
    one, other tests' sandboxes would be cut mid-operation by the crash."""
    with (
        running_server(*netplan.slot_net("rst").astuple(), AENV_HIBERNATE_AFTER="5") as srv,
        sdk_pointed_at(srv),
    ):
        yield srv


def test_restart_between_pause_and_resume(own_server: Server) -> None:
    e2b_env = own_server
    sandboxes: list[Sandbox] = []
    frozen = Sandbox.create(template="base", timeout=300)
    files_only = Sandbox.create(template="base", timeout=300)
    sandboxes += [frozen, files_only]
    start_counter(frozen)
    files_only.files.write("/home/user/f.txt", "files only")
    frozen.pause()
    with e2b_env.client() as c:
        c.post(f"/sandboxes/{files_only.sandbox_id}/pause", json={"memory": False})
    name = f"restart-{frozen.sandbox_id}"
    snap = Sandbox.create(template="base", timeout=120)
    sandboxes.append(snap)
    snap.files.write("/home/user/s.txt", "snap")
    snap_info = snap.create_snapshot(name=name)
    e2b_env.stop(signal.SIGKILL)
    e2b_env.start()
    assert Sandbox.get_info(frozen.sandbox_id).state.value == "paused"
    f = Sandbox.connect(frozen.sandbox_id)
    rising(f, counter(f))
    assert Sandbox.connect(files_only.sandbox_id).files.read("/home/user/f.txt") == "files only"
    c2 = Sandbox.create(template=name, timeout=60)
    sandboxes.append(c2)
    assert c2.files.read("/home/user/s.txt") == "snap"
    Sandbox.delete_snapshot(snap_info.snapshot_id)


def test_lifecycle_responses_carry_server_timing(e2b_env: Server) -> None:
    def stages(r: httpx.Response) -> set[str]:
        assert r.status_code < 300, r.text
        value = r.headers.get("server-timing", "")
        return {part.split(";")[0].strip() for part in value.split(",") if part.strip()}

    with e2b_env.client() as c:
        sid = c.post("/sandboxes", json={"templateID": "base", "timeout": 120}).json()["sandboxID"]
        made = [sid]
        try:
            assert "freeze" in stages(c.post(f"/sandboxes/{sid}/pause"))
            assert "thaw" in stages(c.post(f"/sandboxes/{sid}/connect", json={"timeout": 120}))
            snap = c.post(f"/sandboxes/{sid}/snapshots", json={})
            assert {"checkpoint", "copy", "thaw"} <= stages(snap)  # no restore: it ran on
            c.delete(f"/templates/{snap.json()['snapshotID']}")
            fork = c.post(f"/sandboxes/{sid}/fork", json={"count": 1})
            made += [x["sandbox"]["sandboxID"] for x in fork.json() if "sandbox" in x]
            assert {"checkpoint", "children"} <= stages(fork)
        finally:
            for x in made:
                c.delete(f"/sandboxes/{x}")


def test_long_snapshot_chains_keep_every_change(e2b_env: Server, sandboxes: list[object]) -> None:
    # Snapshots of a running sandbox copy its upper once, then stack only what changed
    # (whiteouts for what went); every 8th copies it whole again, so no stack grows long.
    s = Sandbox.create(template="base", timeout=300)
    sandboxes.append(s)
    start_counter(s)
    base_layers = len(sandbox_record(e2b_env.home, s.sandbox_id)["layers"])
    expected: dict[str, str] = {}
    snaps: list[tuple[str, dict[str, str]]] = []
    for i in range(20):
        # Each round: a new file, an overwrite, a deletion and a dir replaced by a file.
        s.files.write(f"/home/user/chain/f{i}.txt", f"round {i}")
        s.files.write("/home/user/chain/latest.txt", f"latest {i}")
        expected[f"f{i}.txt"] = f"round {i}"
        expected["latest.txt"] = f"latest {i}"
        if i % 3 == 2:
            s.files.remove(f"/home/user/chain/f{i - 1}.txt")
            del expected[f"f{i - 1}.txt"]
        if i % 4 == 0:
            s.commands.run(
                f"mkdir -p /home/user/chain/d{i}/sub && echo x > /home/user/chain/d{i}/sub/x"
            )
            expected[f"d{i}"] = ""
        if i % 4 == 1:
            s.commands.run(
                f"rm -rf /home/user/chain/d{i - 1} && echo file > /home/user/chain/d{i - 1}"
            )
            expected[f"d{i - 1}"] = "file\n"
        snaps.append((s.create_snapshot().snapshot_id, dict(expected)))
    # The sandbox itself never re-stacked: same layers, same upper.
    assert len(sandbox_record(e2b_env.home, s.sandbox_id)["layers"]) == base_layers
    db = sqlite3.connect(str(e2b_env.home / "catalog.db"))
    try:
        for sid, _ in snaps:
            (doc,) = db.execute("SELECT doc FROM templates WHERE id=?", (sid,)).fetchone()
            assert len(json.loads(doc)["layers"]) <= base_layers + 8, sid
    finally:
        db.close()

    def check(sb: Sandbox, want: dict[str, str]) -> None:
        names = {e.name for e in sb.files.list("/home/user/chain")}
        assert names == set(want), names ^ set(want)
        for name, content in want.items():
            if content:
                assert sb.files.read(f"/home/user/chain/{name}") == content, name

    check(s, expected)
    rising(s, counter(s))
    for sid, want in (snaps[9], snaps[-1]):  # a diff deep in a chain, the last one
        child = Sandbox.create(template=sid, timeout=60)
        sandboxes.append(child)
        check(child, want)
        rising(child, counter(child))
    for sid, _ in snaps:
        Sandbox.delete_snapshot(sid)


def test_boot_snapshot_serves_any_memory_size(e2b_env: Server) -> None:
    # New sandboxes are restored from the node's snapshot of a freshly booted one (made at
    # start with the template's 512 MiB); a create asking for another size gets that size.
    with e2b_env.client() as c:
        deadline = time.time() + 60
        while True:
            r = c.post("/sandboxes", json={"templateID": "base", "timeout": 60, "memoryMB": 1024})
            assert r.status_code == 201, r.text
            sid, timing = r.json()["sandboxID"], r.headers.get("server-timing", "")
            if "restore" in timing or time.time() > deadline:
                break
            c.delete(f"/sandboxes/{sid}")  # the boot snapshot was not made yet
            time.sleep(1)
        try:
            assert "restore" in timing and "boot" not in timing, timing
            s = Sandbox.connect(sid)
            total = int(s.commands.run("free -m | awk '/Mem:/ {print $2}'").stdout)
            assert 900 <= total <= 1100, total
            assert s.commands.run("echo ok").stdout == "ok\n"
        finally:
            c.delete(f"/sandboxes/{sid}")


def test_hibernations_right_after_commands_resume_answering() -> None:
    """Each pause hibernates at once, moments after a command, while the node's kept-alive
    connections to the sandbox are still open (they are aborted first): every resume must
    answer. A checkpoint that still held one restored with a wedged envd, about one in ten."""
    with (
        running_server(*netplan.slot_net("hib").astuple(), AENV_HIBERNATE_AFTER="0") as srv,
        sdk_pointed_at(srv),
    ):
        s = Sandbox.create(template="base", timeout=300)
        try:
            for i in range(15):
                assert s.commands.run(f"echo {i}").stdout == f"{i}\n"
                assert s.pause()
                assert sandbox_record(srv.home, s.sandbox_id)["paused"]["tier"] == "hibernated"
                s = Sandbox.connect(s.sandbox_id)
            assert s.commands.run("echo done").stdout == "done\n"
        finally:
            Sandbox.kill(s.sandbox_id)
