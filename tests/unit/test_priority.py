"""The sandboxes' parent cgroup gets a quarter of a process's CPU weight, so the node's own
threads come first under load; without a cgroup v1 CPU controller nothing is written. The
node's session group is raised with it where the kernel groups tasks by session."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from aenv.runtime import priority
from aenv.runtime.priority import SANDBOX_SHARES, favour_node


def test_the_sandboxes_parent_weighs_a_quarter(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.shares").write_text("1024\n")
    assert favour_node("aenv", root=tmp_path)
    assert (tmp_path / "cpu" / "aenv" / "cpu.shares").read_text() == str(SANDBOX_SHARES)
    assert SANDBOX_SHARES * 4 == 1024
    assert favour_node("aenv", root=tmp_path)  # again: the parent exists already


def test_no_cpu_controller_no_change(tmp_path: Path) -> None:
    assert not favour_node("aenv", root=tmp_path)
    assert not (tmp_path / "cpu").exists()


def test_the_node_raises_its_session_group_where_the_kernel_groups_by_session(
    tmp_path: Path,
) -> None:
    autogroup = tmp_path / "autogroup"
    autogroup.write_text("/autogroup-1 nice 0\n")
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        priority.raise_node(autogroup)
    finally:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, before)
    # The kernel reads a nice from what is written there.
    assert autogroup.read_text() == str(priority.NODE_NICE)


def test_no_autogroups_no_error(tmp_path: Path) -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        priority.raise_node(tmp_path / "absent")
    finally:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, before)
    assert not (tmp_path / "absent").exists()
