"""What a sandbox writes is not honoured by the host (issue 10, part 8), on a real node.

A sandbox plants a set-uid root shell (`sudo cp /bin/bash ~/sb; sudo chmod 4755 ~/sb`) and
is snapshotted: inside the sandbox (and in one made from the snapshot) the file is as it was
written and `sudo` works (gVisor keeps set-id semantics to itself: it sets no_new_privs on
every process, which is why the base image's sudo goes through envd); on the host, the
overlays aenv mounts carry nosuid,nodev, and an unprivileged host user can neither reach the
sealed layer's copy nor read the node's catalog and keys."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from e2b import Sandbox

from .conftest import Server

pytestmark = pytest.mark.integration

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
PLANT = "sudo cp /bin/bash /home/user/sb && sudo chmod 4755 /home/user/sb"
SEEN = "stat -c '%a %U' /home/user/sb"


def as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
    """Through a shell: setpriv's own execve still holds root's capabilities."""
    return subprocess.run(
        [*NOBODY, "/bin/sh", "-c", 'exec "$@"', "sh", *cmd],
        capture_output=True,
        text=True,
        timeout=30,
    )


def overlay_mounts(under: Path) -> list[tuple[str, str]]:
    """(mount point, per-mount options) of the overlays mounted below `under`."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            fstype = fields[fields.index("-") + 1]
            if fstype == "overlay" and fields[4].startswith(str(under) + "/"):
                out.append((fields[4], fields[5]))
    return out


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_a_planted_setuid_binary_works_inside_only(
    e2b_env: Server, sandboxes: list[object]
) -> None:
    s = Sandbox.create(template="base", timeout=180)
    sandboxes.append(s)
    s.commands.run(PLANT)
    assert s.commands.run(SEEN).stdout.strip() == "4755 root"

    mounts = overlay_mounts(e2b_env.home)
    assert mounts, "the sandbox's rootfs overlay is not mounted under the home"
    for point, options in mounts:
        flags = options.split(",")
        assert "nosuid" in flags and "nodev" in flags, (point, options)

    snap = s.create_snapshot()
    planted = list(e2b_env.home.glob("layers/*/rootfs/home/user/sb"))
    assert planted, "the snapshot did not seal the planted file into a layer"
    for path in planted:
        assert path.stat().st_mode & 0o4000  # the sandbox's file as it wrote it
        r = as_nobody(str(path), "-p", "-c", "id -u")
        assert r.returncode != 0 and "Permission denied" in r.stderr, r
        assert as_nobody("ls", str(path.parent)).returncode != 0

    # The node's state is not for other users either.
    assert e2b_env.home.stat().st_mode & 0o077 == 0
    for path in e2b_env.home.iterdir():
        if path.is_file():
            assert path.stat().st_mode & 0o077 == 0, path
    for name in ("catalog.db", "catalog.db-wal", "secrets/api-keys.json"):
        path = e2b_env.home / name
        if path.exists():
            r = as_nobody("cat", str(path))
            assert r.returncode != 0 and "Permission denied" in r.stderr, (name, r)

    child = Sandbox.create(template=snap.snapshot_id, timeout=120)
    sandboxes.append(child)
    assert child.commands.run(SEEN).stdout.strip() == "4755 root"
    assert child.commands.run("sudo -n whoami").stdout.strip() == "root"
    for point, options in overlay_mounts(e2b_env.home):
        assert {"nosuid", "nodev"} <= set(options.split(",")), (point, options)
