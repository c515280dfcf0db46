"""envd's out-of-memory kill picks the process with the largest resident memory, never envd
(pid 1, or itself) nor one that asked to be spared (oom_score_adj -1000)."""

from __future__ import annotations

import os
from pathlib import Path

from aenv.envd.oomkill import largest

PAGE = os.sysconf("SC_PAGE_SIZE")


def fake_proc(root: Path, procs: dict[int, tuple[int, str, int]]) -> str:
    """{pid: (resident pages, command, oom_score_adj)} as a /proc tree."""
    for pid, (pages, cmd, adj) in procs.items():
        d = root / str(pid)
        d.mkdir(parents=True)
        (d / "statm").write_text(f"{pages * 2} {pages} 0 0 0 0 0\n")
        (d / "cmdline").write_bytes(cmd.replace(" ", "\0").encode() + b"\0")
        (d / "oom_score_adj").write_text(f"{adj}\n")
    (root / "self").mkdir()  # not a pid
    return str(root)


def test_the_largest_killable_process_is_chosen(tmp_path: Path) -> None:
    proc = fake_proc(
        tmp_path,
        {
            1: (900_000, "envd", 0),  # the sandbox's first process
            7: (800_000, "python3 keep.py", -1000),  # asked to be spared
            12: (400_000, "python3 -c bytearray", 0),
            13: (1_000, "bash -l", 0),
            40: (500_000, "envd child", 0),  # the caller itself
        },
    )
    v = largest(own=40, proc=proc)
    assert v is not None
    assert (v.pid, v.cmd, v.rss_bytes) == (12, "python3 -c bytearray", 400_000 * PAGE)


def test_nothing_to_kill(tmp_path: Path) -> None:
    assert largest(own=5, proc=fake_proc(tmp_path, {1: (10, "envd", 0), 5: (9, "me", 0)})) is None
