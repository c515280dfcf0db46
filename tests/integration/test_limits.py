"""Per-sandbox limits that hold: a memory hog, a fork bomb, a /tmp or disk fill and a CPU hog
stay inside their sandbox (the process fails, the sandbox, its neighbours and the server keep
answering); a sandbox whose runtime dies is reported and its resources released."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import NotEnoughSpaceException, NotFoundException, Sandbox

from tests.helpers import wait_until

from .conftest import Server

pytestmark = pytest.mark.integration

# The shared server's disk size (conftest: AENV_DEFAULT_DISK_MB).
DISK_MB = 2048

HOG = (
    "python3 -c '\n"
    "chunks = []\n"
    "while True:\n"
    "    b = bytearray(32 * 2**20)\n"
    '    b[::4096] = b"x" * len(b[::4096])\n'
    "    chunks.append(b)\n'"
)


@contextlib.contextmanager
def memory_log_on_failure(server: Server) -> Iterator[None]:
    """On failure, the node's lines about memory go into the report: what it saw and did."""
    try:
        yield
    except Exception:
        assert server.log_path is not None
        lines = server.log_path.read_text(errors="replace").splitlines()
        print("\n".join(ln for ln in lines if re.search(r"memory|OOM|oom|lost|died", ln))[-8000:])
        raise


def still_answer(server: Server, *sbxs: Sandbox) -> None:
    with server.client() as c:
        assert c.get("/health").is_success
    for s in sbxs:
        assert s.commands.run("echo ok", timeout=30).stdout.strip() == "ok"


def test_a_memory_hog_dies_alone(server: Server, sandboxes: list[object]) -> None:
    hog = Sandbox.create(template="base", timeout=180)
    neighbour = Sandbox.create(template="base", timeout=180)
    sandboxes += [hog, neighbour]
    with memory_log_on_failure(server):
        r = hog.commands.run(f"{HOG}; echo exit=$?", timeout=120)
    # The allocation fails inside the sandbox (MemoryError, or the process is killed).
    code = int(re.findall(r"exit=(\d+)", r.stdout)[-1])
    assert code != 0
    still_answer(server, hog, neighbour)
    # What the hog held is back: the sandbox can allocate again.
    r = hog.commands.run("python3 -c 'b = bytearray(128 * 2**20); print(len(b))'", timeout=60)
    assert r.stdout.strip() == str(128 * 2**20)


def test_a_fork_bomb_runs_out_of_processes_not_the_node(
    server: Server, sandboxes: list[object]
) -> None:
    bomb = Sandbox.create(template="base", timeout=180)
    neighbour = Sandbox.create(template="base", timeout=180)
    sandboxes += [bomb, neighbour]
    limit = int(bomb.commands.run("ulimit -u").stdout)
    assert 0 < limit < 100_000
    bomb.commands.run("nohup bash -c 'b() { b | b & }; b' > /tmp/bomb.log 2>&1 &", timeout=30)
    # Forks are refused inside the sandbox while it (and the node) keeps answering.
    wait_until(
        lambda: (
            "Resource temporarily unavailable"
            in bomb.commands.run("cat /tmp/bomb.log", user="root", timeout=60).stdout
        ),
        60,
        1,
        "the bomb to run out of processes",
    )
    still_answer(server, neighbour)
    # The bomb's own sandbox answers too: root is not held to the user's process limit (its
    # shells fill the user's); and it goes when killed, taking the bomb with it.
    assert bomb.commands.run("echo ok", user="root", timeout=120).stdout.strip() == "ok"
    bomb.kill()
    with server.client() as c:
        assert c.get(f"/sandboxes/{bomb.sandbox_id}").status_code == 404
    still_answer(server, neighbour)


def test_a_disk_fill_gets_enospc_and_the_files_api_507(
    server: Server, sandboxes: list[object]
) -> None:
    sbx = Sandbox.create(template="base", timeout=180)
    sandboxes.append(sbx)
    # The node's storage (runtime/storage/cowpool.py): a btrfs pool gives each sandbox a quota, ext4
    # disks a filesystem each (whose size `df` then shows).
    pooled = (server.home / "store.btrfs").exists()
    if not pooled:
        size_kb = int(sbx.commands.run("df -k --output=size / | tail -1").stdout)
        assert size_kb <= DISK_MB * 1024  # the writable layer's size, not the host's disk
    # /tmp is part of the sandbox's files: on its disk, not in memory.
    tmp = sbx.commands.run(
        f"dd if=/dev/zero of=/tmp/fill bs=1M count={DISK_MB + 256} 2>&1; true",
        timeout=300,
    )
    assert ("Disk quota exceeded" if pooled else "No space left on device") in tmp.stdout
    written = int(sbx.commands.run("stat -c %s /tmp/fill").stdout)
    assert DISK_MB * 2**20 * 0.9 < written <= DISK_MB * 2**20
    with pytest.raises(NotEnoughSpaceException):  # the files API's 507
        sbx.files.write("/home/user/more.bin", b"y" * (8 * 2**20))
    still_answer(server, sbx)
    sbx.commands.run("rm -f /tmp/fill")
    sbx.files.write("/home/user/more.bin", b"y" * (8 * 2**20))
    assert sbx.commands.run("stat -c %s /home/user/more.bin").stdout.strip() == str(8 * 2**20)


def _cpu_ns(sandbox_id: str) -> int:
    """The CPU time the sandbox's processes used, from its host cgroup (what the cap binds)."""
    (usage,) = Path("/sys/fs/cgroup/cpuacct").glob(f"*/{sandbox_id}-*/cpuacct.usage")
    return int(usage.read_text())


def test_cpu_count_caps_a_cpu_hog(sandboxes: list[object], server: Server) -> None:
    # Two busy processes in a 1-CPU sandbox get one CPU between them, not the node's two.
    with server.client() as c:
        resp = c.post("/sandboxes", json={"templateID": "base", "cpuCount": 1, "timeout": 120})
        assert resp.status_code == 201, resp.text
        sbx = Sandbox.connect(resp.json()["sandboxID"])
    sandboxes.append(sbx)
    burn = (
        "python3 -c '\n"
        "import os, time\n"
        "pids = []\n"
        "for _ in range(2):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        end = time.time() + 4\n"
        "        while time.time() < end: pass\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "for p in pids: os.waitpid(p, 0)\n'"
    )
    before, t0 = _cpu_ns(sbx.sandbox_id), time.monotonic()
    sbx.commands.run(burn, timeout=60)
    used = (_cpu_ns(sbx.sandbox_id) - before) / 1e9
    wall = time.monotonic() - t0
    assert used < 1.25 * wall, f"{used:.1f} CPU seconds in {wall:.1f} s on 1 CPU"


def _sandbox_pids(sandbox_id: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"runsc-sandbox.*{sandbox_id}"], capture_output=True)
    return [int(p) for p in out.stdout.split()]


def test_a_sandbox_whose_runtime_dies_is_reported_and_released(
    server: Server, sandboxes: list[object]
) -> None:
    sbx = Sandbox.create(template="base", timeout=180)
    sandboxes.append(sbx)
    # Its disk: a subvolume of the node's btrfs pool, or an ext4 image.
    pooled = (server.home / "store.btrfs").exists()
    disk = (
        server.home / ("rw" if pooled else "disks") / f"{sbx.sandbox_id}{'' if pooled else '.ext4'}"
    )
    assert disk.exists()
    pids = _sandbox_pids(sbx.sandbox_id)
    assert pids, "no runsc sandbox process found"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)  # as the host's OOM killer would

    def gone() -> bool:
        with server.client() as c:
            listed = {s["sandboxID"] for s in c.get("/sandboxes").json()}
        return sbx.sandbox_id not in listed

    wait_until(gone, 30, 0.5, "the dead sandbox to leave the list")
    with server.client() as c:
        resp = c.get(f"/sandboxes/{sbx.sandbox_id}")
    assert resp.status_code == 404
    assert "died" in resp.json()["message"]
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id)
    wait_until(lambda: not disk.exists(), 30, 0.5, "its disk to be released")
    assert not Path(server.home / "rw" / sbx.sandbox_id).exists()
    with httpx.Client(base_url=server.url, headers={"X-API-Key": server.api_key}) as c:
        assert c.get("/health").is_success


# One allocation far past the sandbox (512 MiB); several processes that together pass it.
HUGE = "python3 -c 'b = bytearray(6 << 30); b[::4096] = bytes(len(b[::4096])); print(len(b))'"
MANY = (
    "for i in 1 2 3 4 5 6; do python3 -c '\n"
    "import time\n"
    "b = bytearray(120 << 20)\n"
    'b[::4096] = b"x" * len(b[::4096])\n'
    "time.sleep(30)' & done; wait; echo done"
)


def test_a_process_past_the_sandbox_memory_is_killed_inside(
    server: Server, sandboxes: list[object]
) -> None:
    """As a VM's kernel would: the process dies, the sandbox, its other processes and envd
    go on, and the kill is in the sandbox's logs and the node's counter."""
    s = Sandbox.create(template="base", timeout=300)
    sandboxes.append(s)
    keeper = s.commands.run("sleep 600", background=True)
    with memory_log_on_failure(server):
        r = s.commands.run(f"{HUGE}; echo exit=$?", timeout=120)
    assert int(re.findall(r"exit=(\d+)", r.stdout)[-1]) != 0
    assert str(6 << 30) not in r.stdout
    still_answer(server, s)
    with memory_log_on_failure(server):
        r = s.commands.run(f"{MANY}; echo exit=$?", timeout=120)
    assert "done" in r.stdout
    still_answer(server, s)
    # /dev/shm is a small tmpfs: a fill is refused there (ENOSPC), nothing is killed.
    r = s.commands.run("dd if=/dev/zero of=/dev/shm/fill bs=1M count=1024; echo exit=$?")
    assert int(re.findall(r"exit=(\d+)", r.stdout)[-1]) != 0
    still_answer(server, s)
    # The other process lived through all of it.
    assert keeper.pid in [p.pid for p in s.commands.list()]
    keeper.kill()
    with server.client() as c:
        logs = c.get(f"/v2/sandboxes/{s.sandbox_id}/logs").json()["logs"]
        metrics = c.get("/metrics").text
    kills = [e for e in logs if e["message"] == "process killed: out of memory"]
    assert kills and any("bytearray" in e["fields"].get("cmd", "") for e in kills)
    assert re.search(r"^aenv_sandbox_oom_kills_total [1-9]", metrics, re.M)
