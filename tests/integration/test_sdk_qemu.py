"""The stock E2B Python SDK against a node whose sandboxes are QEMU microVMs
(`AENV_RUNTIME=qemu`; TCG-emulated where KVM cannot boot a standard guest): the core flows a
user of E2B relies on — create, commands, files, PTY, pause/resume (frozen and from disk),
snapshot, fork, kill — with the project's envd in the guest, unchanged."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import FileNotFoundException, Sandbox, Template
from e2b.sandbox.commands.command_handle import PtySize

from tests import netplan
from tests.helpers import wait_until

from .conftest import Server, running_server, sdk_pointed_at
from .helpers import sandbox_record
from .qemu_env import missing

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(missing() is not None, reason=missing() or ""),
]

COUNTER = "i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.2; done"


@pytest.fixture(scope="module")
def qemu_node() -> Iterator[Server]:
    with (
        running_server(
            *netplan.slot_net("qsd").astuple(),
            AENV_RUNTIME="qemu",
            AENV_HIBERNATE_AFTER="3",
            AENV_CODE_INTERPRETER_AUTOBUILD="0",
        ) as srv,
        sdk_pointed_at(srv),
    ):
        yield srv


@pytest.fixture
def made(qemu_node: Server) -> Iterator[list[Sandbox]]:
    out: list[Sandbox] = []
    yield out
    for s in out:
        with contextlib.suppress(Exception):  # gone already
            Sandbox.kill(s.sandbox_id)


def counter(s: Sandbox) -> int:
    """The background counter's value (0 before its first write; the shell truncates the
    file before each write, so a read may find it empty)."""
    try:
        return int(s.files.read("/tmp/counter").strip() or 0)
    except FileNotFoundException:
        return 0


def rising(s: Sandbox, above: int) -> int:
    return wait_until(lambda: (v := counter(s)) > above and v, 30, 0.2, f"counter past {above}")


def qemu_of(sandbox_id: str) -> list[int]:
    """Host pids of QEMU processes running this sandbox's VMs."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(a.startswith(f"aenv-{sandbox_id}-".encode()) for a in cmd):
                pids.append(int(d))
    return pids


def test_the_node_says_what_runs_its_sandboxes(qemu_node: Server) -> None:
    with qemu_node.client() as c:
        (node,) = c.get("/nodes").json()
    assert node["runtime"]["backend"] == "qemu"
    assert node["runtime"]["accelerator"] in ("kvm", "tcg")


def test_create_commands_files_ports_and_pty(qemu_node: Server, made: list[Sandbox]) -> None:
    s = Sandbox.create(template="base", timeout=300, envs={"GREETING": "hi"})
    made.append(s)
    assert len(qemu_of(s.sandbox_id)) == 1
    r = s.commands.run('echo "$GREETING from $(whoami)"; uname -r')
    greeting, kernel = r.stdout.splitlines()
    assert greeting == "hi from user"
    assert kernel != os.uname().release  # the guest's own kernel, not the host's
    s.files.write("/home/user/dir/a.txt", "hello vm")
    assert s.files.read("/home/user/dir/a.txt") == "hello vm"
    assert [e.name for e in s.files.list("/home/user/dir")] == ["a.txt"]
    s.files.remove("/home/user/dir/a.txt")
    assert not s.files.exists("/home/user/dir/a.txt")

    # A port served in the guest, through the node's proxy, as on gVisor.
    s.files.write("/home/user/www/index.html", "from the vm")
    s.commands.run("cd /home/user/www && python3 -m http.server 8080", background=True)

    def page() -> httpx.Response | None:
        got = httpx.get(
            f"{qemu_node.url}/index.html",
            headers={"Host": f"8080-{s.sandbox_id}.localhost"},
            timeout=10,
        )
        return got if got.status_code == 200 else None

    page_r = wait_until(page, 60, 0.5, "the guest's port 8080 through the proxy")
    assert page_r is not None and page_r.text == "from the vm"

    out = bytearray()
    h = s.pty.create(PtySize(rows=24, cols=80))
    waiter = threading.Thread(target=lambda: h.wait(on_pty=out.extend), daemon=True)
    waiter.start()
    s.pty.send_stdin(h.pid, b"echo pty-$((40+2)); stty size; exit\n")
    waiter.join(60)
    assert b"pty-42" in out and b"24 80" in out


def test_pause_resume_frozen_and_from_disk(qemu_node: Server, made: list[Sandbox]) -> None:
    s = Sandbox.create(template="base", timeout=300)
    made.append(s)
    s.commands.run(COUNTER, background=True)
    v = rising(s, 2)
    s.files.write("/home/user/kept.txt", "kept")
    s.pause()
    again = Sandbox.connect(s.sandbox_id)
    assert again.files.read("/home/user/kept.txt") == "kept"
    v = rising(again, v)  # the same processes go on
    # Paused long enough to be hibernated: the VM's memory and disk on the node's disk.
    again.pause()
    wait_until(
        lambda: (
            (sandbox_record(qemu_node.home, s.sandbox_id)["paused"] or {}).get("tier")
            == "hibernated"
            and not qemu_of(s.sandbox_id)
        ),
        60,
        0.5,
        "the VM hibernated",
    )
    back = Sandbox.connect(s.sandbox_id)
    assert back.files.read("/home/user/kept.txt") == "kept"
    assert counter(back) >= v
    rising(back, counter(back))


def test_snapshot_fork_diff_and_apply(qemu_node: Server, made: list[Sandbox]) -> None:
    p = Sandbox.create(template="base", timeout=300)
    made.append(p)
    p.commands.run(COUNTER, background=True)
    rising(p, 2)
    p.files.write("/home/user/from.txt", "parent")
    snap = p.create_snapshot()
    p.files.write("/home/user/after.txt", "later")
    c = Sandbox.create(template=snap.snapshot_id, timeout=300)
    made.append(c)
    assert c.files.read("/home/user/from.txt") == "parent"
    assert not c.files.exists("/home/user/after.txt")
    rising(c, counter(c))  # its processes came along

    at_fork = counter(p)
    kids = [k for k in p.fork(count=2) if isinstance(k, Sandbox)]
    made.extend(kids)
    assert len(kids) == 2
    seeds = set()
    for i, k in enumerate(kids):
        assert k.files.read("/home/user/from.txt") == "parent"
        assert counter(k) >= at_fork
        rising(k, counter(k))
        k.files.write("/home/user/mine.txt", f"kid {i}")
        seeds.add(k.commands.run("head -c 16 /dev/urandom | od -An -tx1").stdout)
    assert len(seeds) == 2
    assert [k.files.read("/home/user/mine.txt") for k in kids] == ["kid 0", "kid 1"]
    assert not p.files.exists("/home/user/mine.txt")
    # The fork tree reads a running VM's files on the host: a child's diff from its fork
    # point, and its changes applied to the parent (both counters ran: theirs wins).
    with qemu_node.client() as http:
        r = http.get(f"/sandboxes/{kids[0].sandbox_id}/diff")
        assert r.status_code == 200, r.text
        assert {(x["path"], x["change"]) for x in r.json()} >= {("/home/user/mine.txt", "added")}
        r = http.post(
            f"/sandboxes/{p.sandbox_id}/apply",
            json={"from": kids[0].sandbox_id, "strategy": "theirs"},
        )
        assert r.status_code == 200, r.text
    assert p.files.read("/home/user/mine.txt") == "kid 0"
    assert Sandbox.delete_snapshot(snap.snapshot_id)


def test_kill_ends_the_vm(made: list[Sandbox]) -> None:
    s = Sandbox.create(template="base", timeout=300)
    assert s.is_running() and qemu_of(s.sandbox_id)
    s.kill()
    assert not s.is_running()
    wait_until(lambda: not qemu_of(s.sandbox_id), 15, 0.1, "the QEMU process gone")


def test_template_build_steps_and_a_files_only_pause(
    qemu_node: Server, made: list[Sandbox], tmp_path: Path
) -> None:
    """Each build step runs in a VM of its own and commits what it wrote (read out of the
    guest's disk); a files-only pause keeps the files and reboots the guest."""
    (tmp_path / "hello.txt").write_text("from the context\n")
    template = (
        Template(file_context_path=str(tmp_path))
        .from_template("base")
        .copy("hello.txt", "/data/")
        .make_symlink("/data/hello.txt", "/data/link")
        .run_cmd("echo built > /data/built.txt")
    )
    name = f"qemu-build-{os.getpid()}"
    Template.build(template, name)
    s = Sandbox.create(template=name, timeout=300)
    made.append(s)
    out = s.commands.run("cat /data/link /data/built.txt").stdout
    assert out == "from the context\nbuilt\n"

    s.files.write("/home/user/marker.txt", "persisted")
    boot = s.files.read("/proc/sys/kernel/random/boot_id")
    assert s.pause(keep_memory=False)
    back = s.connect()
    assert back.files.read("/home/user/marker.txt") == "persisted"
    assert back.files.read("/proc/sys/kernel/random/boot_id") != boot  # a fresh boot
    with qemu_node.client() as http:
        assert http.delete(f"/templates/{name}").status_code in (200, 204)
