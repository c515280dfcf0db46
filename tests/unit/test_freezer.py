"""The cgroup freezer's file protocol (v1 and v2), on a fake cgroup tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.errors import RuntimeFailure
from aenv.runtime.freezer import Freezer


def test_v1_freeze_and_thaw(tmp_path: Path) -> None:
    d = tmp_path / "freezer" / "pfx" / "c1"
    d.mkdir(parents=True)
    (d / "freezer.state").write_text("THAWED\n")
    f = Freezer(tmp_path)
    assert f.available("/pfx/c1") and not f.is_frozen("/pfx/c1")
    f.freeze("/pfx/c1")
    assert (d / "freezer.state").read_text() == "FROZEN" and f.is_frozen("/pfx/c1")
    f.thaw("/pfx/c1")
    assert not f.is_frozen("/pfx/c1")


def test_v2_freeze_waits_for_frozen_and_gives_up_thawed(tmp_path: Path) -> None:
    d = tmp_path / "pfx" / "c2"
    d.mkdir(parents=True)
    (d / "cgroup.freeze").write_text("0\n")
    (d / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    f = Freezer(tmp_path)
    # The kernel never reports "frozen 1" here: the freeze must not claim success.
    with pytest.raises(RuntimeFailure, match="did not freeze"):
        f.freeze("/pfx/c2", timeout=0.05)
    assert (d / "cgroup.freeze").read_text() == "0"
    (d / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    f.freeze("/pfx/c2")
    assert f.is_frozen("/pfx/c2")


def test_no_freezer(tmp_path: Path) -> None:
    f = Freezer(tmp_path)
    assert not f.available("/pfx/none") and not f.is_frozen("/pfx/none")
    f.thaw("/pfx/none")  # nothing to do
    with pytest.raises(RuntimeFailure):
        f.freeze("/pfx/none")
