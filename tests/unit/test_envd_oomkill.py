"""envd's out-of-memory kill: only while the sandbox is short of memory by its own count; the
largest process of the session using the most memory, never envd (pid 1, or itself) nor one
that asked to be spared (oom_score_adj -1000)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

from aenv.envd.oomkill import kill_largest, largest, short_of_memory

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


def fake_proc(
    root: Path,
    procs: dict[int, tuple[int, str, int, int]],
    total: int = 512 * MIB,
    available: int = 8 * MIB,
) -> str:
    """{pid: (resident pages, command, oom_score_adj, session)} as a /proc tree."""
    root.mkdir(parents=True, exist_ok=True)
    for pid, (pages, cmd, adj, sid) in procs.items():
        d = root / str(pid)
        d.mkdir(parents=True)
        (d / "statm").write_text(f"{pages * 2} {pages} 0 0 0 0 0\n")
        (d / "stat").write_text(f"{pid} ({cmd.split()[0]} (x)) S 1 {sid} {sid} 0 -1 0\n")
        (d / "cmdline").write_bytes(cmd.replace(" ", "\0").encode() + b"\0")
        (d / "oom_score_adj").write_text(f"{adj}\n")
    (root / "self").mkdir()  # not a pid
    (root / "meminfo").write_text(
        f"MemTotal: {total >> 10} kB\nMemFree: {available >> 10} kB\n"
        f"MemAvailable: {available >> 10} kB\n"
    )
    return str(root)


def test_the_largest_killable_process_is_chosen(tmp_path: Path) -> None:
    proc = fake_proc(
        tmp_path,
        {
            1: (900_000, "envd", 0, 1),  # the sandbox's first process
            7: (800_000, "python3 keep.py", -1000, 7),  # asked to be spared
            12: (400_000, "python3 -c bytearray", 0, 11),
            11: (1_000, "bash -l", 0, 11),
            40: (500_000, "envd child", 0, 40),  # the caller itself
        },
    )
    v = largest(own=40, proc=proc)
    assert v is not None
    assert (v.pid, v.cmd, v.rss_bytes) == (12, "python3 -c bytearray", 400_000 * PAGE)


def test_a_fork_bomb_loses_its_own_shells_not_a_command_beside_it(tmp_path: Path) -> None:
    bomb = {pid: (900, "bash -c b", 0, 100) for pid in range(100, 160)}
    proc = fake_proc(tmp_path, {**bomb, 50: (1_000, "bash -c pkill", 0, 50)})
    v = largest(own=2, proc=proc)
    assert v is not None and 100 <= v.pid < 160


def test_nothing_to_kill(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, {1: (10, "envd", 0, 1), 5: (9, "me", 0, 5)})
    assert largest(own=5, proc=proc) is None


def test_short_of_memory_by_the_sandbox_own_count(tmp_path: Path) -> None:
    assert short_of_memory(fake_proc(tmp_path / "a", {}, available=40 * MIB))
    assert not short_of_memory(fake_proc(tmp_path / "b", {}, available=300 * MIB))


def test_a_kill_when_the_sandbox_has_room_again_kills_nothing(tmp_path: Path) -> None:
    """The host's signal came after the culprit's memory was freed: the shell that started
    it is not the next victim."""
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        proc = fake_proc(
            tmp_path, {child.pid: (1_000, "bash -c", 0, child.pid)}, available=400 * MIB
        )
        assert asyncio.run(kill_largest(proc, wait=0.1)) == {"killed": None}
        assert child.poll() is None
        # ...unless the node insists (what is short is the sentry's own memory).
        forced = asyncio.run(kill_largest(proc, wait=0.1, force=True))
        assert forced["killed"] == {"pid": child.pid, "cmd": "bash -c", "rss_bytes": 1_000 * PAGE}
        assert child.wait(timeout=10) == -9
        child = subprocess.Popen(["sleep", "60"], start_new_session=True)
        proc = fake_proc(
            tmp_path / "b", {child.pid: (1_000, "bash -c", 0, child.pid)}, available=400 * MIB
        )
        # Short of memory: the same process is killed.
        (tmp_path / "b" / "meminfo").write_text("MemTotal: 524288 kB\nMemAvailable: 1024 kB\n")
        out = asyncio.run(kill_largest(proc, wait=0.1))
        assert out["killed"] == {"pid": child.pid, "cmd": "bash -c", "rss_bytes": 1_000 * PAGE}
        assert child.wait(timeout=10) == -9
    finally:
        child.kill()
        child.wait()
