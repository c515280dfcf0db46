"""A sandbox's checkpoint does not grow with the commands it has run (gVisor's procfs would
keep every dead process in it), and the step that prevents it leaks no privilege."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from e2b import Sandbox

from .conftest import Server

pytestmark = pytest.mark.integration


def snapshot_image_bytes(server: Server, snapshot_id: str) -> int:
    """The size of a snapshot's memory image (checkpoint + pages) on the node."""
    db = sqlite3.connect(str(server.home / "catalog.db"))
    try:
        (doc,) = db.execute("SELECT doc FROM templates WHERE id=?", (snapshot_id,)).fetchone()
    finally:
        db.close()
    image = server.home / "images" / str(json.loads(doc)["checkpoint"])
    files = [p for p in Path(image).iterdir() if p.is_file()]
    assert files, f"no image files in {image}"
    return sum(p.stat().st_size for p in files)


def test_snapshot_size_does_not_grow_with_commands(
    e2b_env: Server, sandboxes: list[object]
) -> None:
    fresh = Sandbox.create(template="base", timeout=300)
    sandboxes.append(fresh)
    busy = Sandbox.create(template="base", timeout=300)
    sandboxes.append(busy)
    # 300 processes that each read their own /proc entry, as ps, pgrep, top, Python's
    # psutil or Node do, and 50 more agent commands.
    busy.commands.run("for i in $(seq 300); do sh -c 'cat /proc/$$/stat >/dev/null'; done")
    for _ in range(50):
        busy.commands.run("ps aux >/dev/null")
    sizes = {}
    for name, sbx in (("fresh", fresh), ("busy", busy)):
        snap = sbx.create_snapshot()
        try:
            sizes[name] = snapshot_image_bytes(e2b_env, snap.snapshot_id)
        finally:
            Sandbox.delete_snapshot(snap.snapshot_id)
    # gVisor's procfs would keep each of them, dead, in the image: ~115 KiB apiece.
    assert sizes["busy"] < sizes["fresh"] + 6 * 1024 * 1024, sizes


def test_proc_works_and_root_cannot_mount(e2b_env: Server, sandboxes: list[object]) -> None:
    sbx = Sandbox.create(template="base", timeout=120)
    sandboxes.append(sbx)
    out = sbx.commands.run("sleep 30 & ps -eo pid,comm | grep -c sleep; cat /proc/1/cmdline")
    assert out.stdout.splitlines()[0] == "1"
    # envd gave CAP_SYS_ADMIN up before starting anything: root cannot mount.
    denied = sbx.commands.run(
        "sudo mount -t tmpfs none /mnt; echo rc=$?; grep CapBnd /proc/self/status",
        user="root",
    )
    assert "rc=0" not in denied.stdout, denied.stdout
    bnd = int(denied.stdout.split("CapBnd:")[1].split()[0], 16)
    assert not bnd & (1 << 21), denied.stdout  # CAP_SYS_ADMIN
