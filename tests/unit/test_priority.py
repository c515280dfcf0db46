"""The sandboxes' parent cgroup gets a quarter of a process's CPU weight, so the node's own
threads come first under load; without a cgroup v1 CPU controller nothing is written."""

from __future__ import annotations

from pathlib import Path

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
