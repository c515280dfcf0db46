"""envd's identity renewal (identity.py) against temp paths and a recording stand-in for
libc (the real thing needs a sandbox: tests/integration/test_fork_identity.py), and /init's
`sandboxID`, which renews it only for a sandbox envd has not been initialised for."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from aenv.envd import identity
from tests.unit.test_envd_procfs import Libc, as_libc


@pytest.fixture
def paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "etc").mkdir()
    (tmp_path / "dbus").mkdir()
    monkeypatch.setattr(identity, "MACHINE_ID", str(tmp_path / "etc/machine-id"))
    monkeypatch.setattr(identity, "DBUS_MACHINE_ID", str(tmp_path / "dbus/machine-id"))
    monkeypatch.setattr(identity, "BOOT_ID_SOURCE", str(tmp_path / "run/aenv/boot_id"))
    return tmp_path


def test_machine_id_is_written_anew_with_dbus_copy(paths: Path) -> None:
    (paths / "etc/machine-id").write_text("0" * 32 + "\n")
    (paths / "dbus/machine-id").write_text("0" * 32 + "\n")
    assert identity.renew_machine_id() is None
    first = (paths / "etc/machine-id").read_text()
    assert len(first.strip()) == 32 and first != "0" * 32 + "\n"
    assert (paths / "dbus/machine-id").read_text() == first
    assert identity.renew_machine_id() is None
    assert (paths / "etc/machine-id").read_text() != first


def test_machine_id_is_created_and_a_dbus_symlink_left(paths: Path) -> None:
    (paths / "dbus/machine-id").symlink_to(paths / "etc/machine-id")
    assert identity.renew_machine_id() is None
    assert (paths / "dbus/machine-id").is_symlink()
    assert (paths / "dbus/machine-id").read_text() == (paths / "etc/machine-id").read_text()


def test_boot_id_is_bind_mounted_over_the_restored_one(paths: Path) -> None:
    libc = Libc(fail={"umount2"})  # not a mount point yet: fine
    assert identity.renew_boot_id(as_libc(libc)) is None
    source = str(paths / "run/aenv/boot_id")
    target = identity.BOOT_ID.encode()
    assert [c[:3] for c in libc.calls] == [
        ("umount2", target, identity._MNT_DETACH),
        ("mount", source.encode(), target),
        ("mount", None, target),
    ]
    assert len(Path(source).read_text().strip()) == 36


def test_boot_id_reports_a_refused_mount(paths: Path) -> None:
    problem = identity.renew_boot_id(as_libc(Libc(fail={"mount"})))
    assert problem is not None and problem.startswith("boot_id: bind mount")


def test_renew_reseeds_envds_random(paths: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(identity, "renew_boot_id", lambda: None)
    random.seed(1)
    cloned = random.getstate()
    assert identity.renew() == []
    assert random.getstate() != cloned


@pytest.mark.skipif(os.geteuid() != 0, reason="envd tests run as root")
def test_init_takes_a_sandbox_id_and_leaves_a_host_alone(
    envd_launcher: Callable[..., str],
) -> None:
    before = Path("/etc/machine-id").read_bytes() if Path("/etc/machine-id").exists() else None
    url = envd_launcher({})
    with httpx.Client(base_url=url, timeout=20) as c:
        assert c.post("/init", json={"sandboxID": 1}).status_code == 400
        assert c.post("/init", json={"sandboxID": "i1"}).status_code == 204
    after = Path("/etc/machine-id").read_bytes() if Path("/etc/machine-id").exists() else None
    assert after == before  # not a sandbox's envd: identity.ENABLED stays off
