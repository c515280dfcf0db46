"""Fork-safe children: every child of a fork, and every sandbox made from a snapshot, has its
own identity (machine-id, boot id, fresh randomness for the processes it starts) while its
files are still the parent's. With the stock E2B Python SDK on real gVisor."""

from __future__ import annotations

import pytest
from e2b import Sandbox

from .conftest import Server

pytestmark = pytest.mark.integration

# One line per fact, so a child's identity is a tuple that compares whole.
PROBE = (
    "cat /etc/machine-id 2>/dev/null || echo none; cat /proc/sys/kernel/random/boot_id; cat /proc/sys/kernel/hostname; "
    "python3 -c 'import os,uuid,random; print(os.urandom(8).hex(), uuid.uuid4(), random.random())'"
)
FIELDS = ("machine-id", "boot_id", "hostname", "randomness")


def identity(s: Sandbox) -> dict[str, str]:
    out = s.commands.run(PROBE).stdout.strip().splitlines()
    assert len(out) == len(FIELDS), out
    return dict(zip(FIELDS, out, strict=True))


def assert_distinct(ids: list[dict[str, str]], fields: tuple[str, ...]) -> None:
    for f in fields:
        values = [i[f] for i in ids]
        assert all(values) and len(set(values)) == len(values), (f, values)


def test_fork_children_have_their_own_identity(e2b_env: Server, sandboxes: list[object]) -> None:
    p = Sandbox.create(template="base", timeout=120)
    sandboxes.append(p)
    p.files.write("/home/user/shared.txt", "written before the fork")
    parent = identity(p)
    kids = p.fork(count=3)
    children = [k for k in kids if isinstance(k, Sandbox)]
    sandboxes.extend(children)
    assert len(children) == 3, kids
    ids = [identity(k) for k in children]
    # Every child differs from its siblings and from the parent in all of them; the
    # hostname is the same fixed "sandbox" everywhere (not derived from the id), so not it.
    assert_distinct([parent, *ids], ("machine-id", "boot_id", "randomness"))
    assert {i["hostname"] for i in [parent, *ids]} == {"sandbox"}
    # The parent keeps its own identity across the checkpoint that made the children.
    after = identity(p)
    assert (after["machine-id"], after["boot_id"]) == (parent["machine-id"], parent["boot_id"])
    for k in children:  # still a fork: the files are the parent's
        assert k.files.read("/home/user/shared.txt") == "written before the fork"


def test_creates_from_one_snapshot_differ(e2b_env: Server, sandboxes: list[object]) -> None:
    s = Sandbox.create(template="base", timeout=120)
    sandboxes.append(s)
    s.files.write("/home/user/shared.txt", "in the snapshot")
    snap = s.create_snapshot()
    try:
        made = [Sandbox.create(template=snap.snapshot_id, timeout=120) for _ in range(2)]
        sandboxes.extend(made)
        ids = [identity(c) for c in made]
        assert_distinct([identity(s), *ids], ("machine-id", "boot_id", "randomness"))
        for c in made:
            assert c.files.read("/home/user/shared.txt") == "in the snapshot"
    finally:
        Sandbox.delete_snapshot(snap.snapshot_id)
