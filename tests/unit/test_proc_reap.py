"""Reaping adopted runsc processes (`runtime/_proc.py`): an exited child named like runsc's
re-executed processes (`exe`) is reaped from this process's children list, and nothing
else is: a child still running, or one with another name, is left alone."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from pathlib import Path

from aenv.runtime import _proc


def spawn(path: Path, *args: str) -> int:
    return os.posix_spawn(str(path), [path.name, *args], dict(os.environ))


def state(pid: int) -> str | None:
    st = _proc.proc_stat(pid)
    return None if st is None else st.state


def until_zombie(pid: int) -> None:
    for _ in range(500):
        if state(pid) in ("Z", "X"):
            return
        time.sleep(0.01)
    raise AssertionError(f"{pid} did not exit")


def test_an_exited_runsc_child_is_reaped_and_others_are_not(tmp_path: Path) -> None:
    true = shutil.which("true")
    sleep = shutil.which("sleep")
    assert true and sleep
    exe = tmp_path / _proc.RUNSC_COMM
    exe.symlink_to(true)
    other = tmp_path / "other"
    other.symlink_to(true)
    runner = tmp_path / "sleeper"
    runner.symlink_to(sleep)
    dead, foreign, alive = spawn(exe), spawn(other), spawn(runner, "30")
    try:
        until_zombie(dead)
        until_zombie(foreign)
        kids = _proc.children()
        assert kids is not None and {dead, foreign, alive} <= set(kids)
        assert _proc.reap_adopted() >= 1
        assert state(dead) is None  # reaped: gone
        assert state(foreign) in ("Z", "X") and state(alive) not in (None, "Z", "X")
    finally:
        os.kill(alive, 9)
        for pid in (foreign, alive, dead):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def test_wait_exited_wakes_when_a_runsc_child_exits_and_reaps_it(tmp_path: Path) -> None:
    sleep = shutil.which("sleep")
    assert sleep
    exe = tmp_path / _proc.RUNSC_COMM
    exe.symlink_to(sleep)
    short, long = spawn(exe, "0.3"), spawn(exe, "30")
    try:
        t0 = time.monotonic()
        assert asyncio.run(_proc.wait_exited([short], 10.0))
        # Woken by the exit itself, not at the end of the time limit.
        assert time.monotonic() - t0 < 5.0
        assert state(short) is None  # reaped
        t0 = time.monotonic()
        assert not asyncio.run(_proc.wait_exited([long, short], 0.3))
        assert 0.25 <= time.monotonic() - t0 < 5.0
        assert state(long) not in (None, "Z", "X")
    finally:
        os.kill(long, 9)
        for pid in (short, long):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
