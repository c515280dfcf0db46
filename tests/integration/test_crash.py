"""kill -9 of a real server in the middle of create, pause, hibernate, snapshot and fork, at
named points (the server kills itself there: `AENV_CRASH_FILE`) and after a delay (killed
from here), then a restart: every sandbox listed is usable (runs commands, has the files it
had, pauses and resumes), nothing half-made is listed, the host holds exactly what the
listed sandboxes need (containers, network namespaces, veths, mounts, upper dirs) and, once
they are killed, nothing; a snapshot reported created still restores. Last, SIGTERM
hibernates a frozen sandbox (its processes survive the restart)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from aenv.runtime.rootfs import mount_points
from tests import netplan
from tests.integration.conftest import Server, running_server
from tests.integration.helpers import sandbox_record

pytestmark = pytest.mark.integration

PREFIX, CIDR = netplan.slot_net("crs").prefix, netplan.slot_net("crs").cidr
MARK = "/home/user/crash.txt"


@pytest.fixture(scope="module")
def node() -> Iterator[Server]:
    with running_server(
        PREFIX,
        CIDR,
        # Exact accounting of the host: no warm sandboxes, slots or boot snapshots.
        AENV_SANDBOX_POOL_SIZE="0",
        AENV_NET_POOL_SIZE="0",
        AENV_BOOT_SNAPSHOTS="false",
        # A pause hibernates at once, within its request (the hibernation crash points).
        AENV_HIBERNATE_AFTER="0",
        AENV_CRASH_FILE=str(Path("/tmp") / f"aenv-{PREFIX}-{os.getpid()}.crash"),
    ) as srv:
        saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
        os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY=srv.api_key)
        try:
            yield srv
        finally:
            Path(srv.env["AENV_CRASH_FILE"]).unlink(missing_ok=True)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture(scope="module")
def kept_snapshot(node: Server) -> str:
    """A snapshot reported created before any crash: every restart must leave it whole."""
    s = Sandbox.create(template="base", timeout=120)
    try:
        s.files.write("/home/user/kept.txt", "kept across crashes")
        return str(s.create_snapshot(name="crash-kept").snapshot_id)
    finally:
        s.kill()


# ---------------------------------------------------------------------------- helpers
def listed(node: Server) -> list[dict[str, Any]]:
    with node.client() as c:
        r = c.get("/v2/sandboxes", params={"state": ["running", "paused"], "limit": 1000})
        r.raise_for_status()
        return list(r.json())


def host(node: Server) -> dict[str, set[str]]:
    """This node's traces on the host, by sandbox id where they carry one."""
    home = node.home
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    states = (home / "runsc").glob("*_sandbox:*.state")
    return {
        "containers": {p.name.split("_sandbox:")[0].rsplit("-", 1)[0] for p in states},
        "sandbox processes": {
            argv[-1].rsplit("-", 1)[0]
            for argv in map(_cmdline, Path("/proc").glob("[0-9]*"))
            if argv and argv[0] == "runsc-sandbox" and f"--root={home / 'runsc'}" in argv
        },
        "bundles": {p.name for p in (home / "sandboxes").glob("*") if p.is_dir()},
        "mounts": {str(p) for p in mount_points(home / "sandboxes")},
        "disk mounts": {p.name for p in mount_points(home / "rw") if p.parent == home / "rw"},
        # ext4 images, or the subvolumes of a btrfs pool (a subvolume's root is inode 256).
        "disks": {
            p.name.removesuffix(".ext4")
            for p in (home / "disks").glob("*.ext4")
            if not p.name.startswith("spare-")
        }
        | {p.name for p in (home / "rw").glob("*") if p.is_dir() and p.stat().st_ino == 256},
        "netns": {
            n.split()[0] for n in netns.splitlines() if n.split() and n.startswith(f"{PREFIX}-")
        },
        "veths": {n for n in os.listdir("/sys/class/net") if n.startswith(f"{PREFIX}h")},
        "rw": {p.name for p in (home / "rw").glob("*")},
    }


def _cmdline(proc: Path) -> list[str]:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def agrees(node: Server) -> list[dict[str, Any]]:
    """The listed sandboxes, once the host holds exactly what they need: a container,
    bundle, mount, slot (two namespaces and a veth) for each that has one in the catalog,
    an upper dir and a disk for each, nothing for anything else."""
    sandboxes = listed(node)
    ids = {s["sandboxID"] for s in sandboxes}
    holding = {i for i in ids if sandbox_record(node.home, i).get("instance")}
    for s in sandboxes:  # nothing listed running without its container
        if s["state"] == "running":
            assert s["sandboxID"] in holding, s

    def matches() -> dict[str, set[str]] | None:
        h = host(node)
        want = {
            "containers": holding,
            "sandbox processes": holding,
            "bundles": holding,
            "rw": ids,
            "disks": ids,
        }
        counts = {"mounts": len(holding), "netns": 2 * len(holding), "veths": len(holding)}
        ok = (
            all(h[k] == v for k, v in want.items())
            and all(len(h[k]) == n for k, n in counts.items())
            and h["disk mounts"] <= ids  # a paused sandbox's disk may stay mounted
        )
        return None if ok else h

    deadline = time.monotonic() + 60  # deletes of stale containers finish in the background
    while (found := matches()) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert node.log_path is not None
    log = "\n".join(node.log_path.read_text(errors="replace").splitlines()[-40:])
    assert found is None, f"host {found} vs listed {ids} (with a container {holding})\n{log}"
    return sandboxes


def kill_all(node: Server) -> None:
    with node.client() as c:
        for s in listed(node):
            c.delete(f"/sandboxes/{s['sandboxID']}")


def arm(node: Server, point: str) -> None:
    Path(node.env["AENV_CRASH_FILE"]).write_text(point)


def crash(node: Server, method: str, path: str, body: Any, *, delay: float | None) -> None:
    """Sends the request; the server dies at the armed point, or is killed `delay` seconds
    in; then it is started again (nothing armed)."""
    assert node.proc is not None
    proc = node.proc

    def send() -> None:
        with contextlib.suppress(httpx.HTTPError), node.client() as c:
            c.request(method, path, json=body)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    if delay is not None:
        # The delay is the case itself: a kill at a moment no crash point names, somewhere
        # inside the request (no event marks "somewhere inside").
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=120) == -signal.SIGKILL
    t.join(30)
    node.proc = None
    Path(node.env["AENV_CRASH_FILE"]).unlink(missing_ok=True)
    node.start()


def usable(sandbox_id: str, marker: str) -> None:
    """Resumes it if paused; it runs commands, has its file, pauses and comes back."""
    s = Sandbox.connect(sandbox_id, timeout=120)
    assert s.commands.run(f"cat {MARK}").stdout == marker
    s.pause()
    s = Sandbox.connect(sandbox_id, timeout=120)
    assert s.commands.run("echo again").stdout.strip() == "again"


def made(marker: str) -> str:
    s = Sandbox.create(template="base", timeout=300, metadata={"case": marker})
    s.files.write(MARK, marker)
    s.commands.run("sleep 3600", background=True)
    return str(s.sandbox_id)


# ---------------------------------------------------------------------------- the crashes
CASES = [
    # (operation, named point or None, delay in seconds or None)
    ("create", "create.booted", None),
    ("pause", "pause.frozen", None),
    ("hibernate", "hibernate.checkpointed", None),
    ("hibernate", "hibernate.released", None),
    ("hibernate", None, 0.08),
    ("snapshot", "snapshot.checkpointed", None),
    ("snapshot", "snapshot.copied", None),
    ("snapshot", "snapshot.registered", None),
    ("snapshot", None, 0.35),
    ("fork", "fork.snapshotted", None),
    ("fork", "fork.parent_back", None),
    ("fork", None, 0.4),
]


@pytest.mark.parametrize(
    ("op", "point", "delay"), CASES, ids=[f"{o}-{p or f'{d}s'}" for o, p, d in CASES]
)
def test_kill9_during(
    node: Server, kept_snapshot: str, op: str, point: str | None, delay: float | None
) -> None:
    marker = f"{op}-{point or delay}"
    source = None if op == "create" else made(marker)
    request = {
        "create": ("POST", "/sandboxes", {"templateID": "base", "timeout": 300}),
        "pause": ("POST", f"/sandboxes/{source}/pause", {}),
        "hibernate": ("POST", f"/sandboxes/{source}/pause", {}),
        "snapshot": ("POST", f"/sandboxes/{source}/snapshots", {"name": f"cut-{marker}"}),
        "fork": ("POST", f"/sandboxes/{source}/fork", {"count": 2}),
    }[op]
    if point is not None:
        arm(node, point)
    try:
        crash(node, *request, delay=delay)
        sandboxes = agrees(node)
        if source is None:
            assert sandboxes == []  # the create never answered: nothing half-made
        else:
            assert source in {s["sandboxID"] for s in sandboxes}
        for s in sandboxes:  # the source, and any fork child that was whole
            assert s["metadata"] == {"case": marker}
            usable(s["sandboxID"], marker)
        if op == "snapshot":
            with node.client() as c:
                cut = c.get("/snapshots", params={"name": f"cut-{marker}"}).json()
            for snap in cut:  # registered before the crash: then it is whole
                child = Sandbox.create(template=snap["snapshotID"], timeout=60)
                assert child.commands.run(f"cat {MARK}").stdout == marker
                child.kill()
        k = Sandbox.create(template=kept_snapshot, timeout=60)
        assert k.files.read("/home/user/kept.txt") == "kept across crashes"
        k.kill()
    finally:
        Path(node.env["AENV_CRASH_FILE"]).unlink(missing_ok=True)
        if node.proc is None:
            node.start()
        kill_all(node)
    assert agrees(node) == []


def test_sigterm_hibernates_frozen_sandboxes(node: Server) -> None:
    """A clean stop checkpoints what is only frozen (it would not survive a reboot of the
    host): no container is left, and its processes come back after the restart."""
    node.stop()
    node.env["AENV_HIBERNATE_AFTER"] = "3600"
    node.start()
    s = Sandbox.create(template="base", timeout=300)
    s.commands.run("sleep 4242", background=True)
    s.pause()
    assert sandbox_record(node.home, s.sandbox_id)["paused"]["tier"] == "frozen"
    node.stop(signal.SIGTERM)
    assert sandbox_record(node.home, s.sandbox_id)["paused"]["tier"] == "hibernated"
    assert host(node)["containers"] == set()
    node.start()
    try:
        back = Sandbox.connect(s.sandbox_id, timeout=120)
        assert "sleep 4242" in back.commands.run("ps aux").stdout
    finally:
        kill_all(node)
    assert agrees(node) == []
