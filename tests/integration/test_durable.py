"""Snapshots in the durable repository: checksummed, fetched when missing, shared via S3."""

from __future__ import annotations

import re
import shutil
import time
import uuid

import httpx
import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException

from tests import netplan
from tests.helpers import wait_until

from .conftest import Server, running_server

pytestmark = pytest.mark.integration


def _template_doc(server: Server, template_id: str) -> dict[str, object]:
    import json
    import sqlite3

    db = sqlite3.connect(str(server.home / "catalog.db"))
    try:
        row = db.execute("SELECT doc FROM templates WHERE id=?", (template_id,)).fetchone()
    finally:
        db.close()
    return dict(json.loads(row[0])) if row else {}


def _wait_published(server: Server, template_id: str, timeout: float = 120) -> None:
    wait_until(
        lambda: _template_doc(server, template_id).get("published"),
        timeout,
        0.3,
        f"snapshot {template_id} to be published",
    )


def _s3_keys(endpoint: str, bucket: str, prefix: str) -> list[str]:
    r = httpx.get(f"{endpoint}/{bucket}", params={"list-type": "2", "prefix": prefix}, timeout=10)
    r.raise_for_status()
    return re.findall(r"<Key>([^<]+)</Key>", r.text)


def test_corrupt_artifact_is_a_clear_error(e2b_env: Server, sandboxes: list[object]) -> None:
    s = Sandbox.create(template="base", timeout=120)
    sandboxes.append(s)
    s.files.write("/home/user/x.txt", "x")
    snap = s.create_snapshot()
    _wait_published(e2b_env, snap.snapshot_id)
    # Drop the node's copy so the image must come from the repository, then corrupt it there.
    shutil.rmtree(e2b_env.home / "images" / snap.snapshot_id)
    shutil.rmtree(e2b_env.home / "cache" / "images" / snap.snapshot_id, ignore_errors=True)
    pages = [p for p in (e2b_env.home / "repo" / "images" / snap.snapshot_id).rglob("pages.img*")]
    assert pages, "the memory image was not in the repository"
    p = pages[0]
    p.chmod(0o644)
    with p.open("r+b") as f:
        f.seek(max(0, p.stat().st_size // 2))
        f.write(b"\xde\xad\xbe\xef" * 4)
    before = {x.sandbox_id for x in Sandbox.list().next_items()}
    with pytest.raises(SandboxException) as ei:
        Sandbox.create(template=snap.snapshot_id, timeout=60)
    assert "corrupt" in str(ei.value).lower() or "checksum" in str(ei.value).lower(), str(ei.value)
    assert {x.sandbox_id for x in Sandbox.list().next_items()} == before  # nothing half-made
    Sandbox.delete_snapshot(snap.snapshot_id)


def test_snapshot_travels_through_s3_to_a_fresh_node(s3_endpoint: str) -> None:
    bucket = f"aenv-{uuid.uuid4().hex[:12]}"
    assert httpx.put(f"{s3_endpoint}/{bucket}", timeout=10).status_code == 200
    s3 = dict(
        AENV_SNAPSHOT_REPO=f"s3://{bucket}/nodes",
        AENV_S3_ENDPOINT=s3_endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    name = f"s3-{uuid.uuid4().hex[:8]}"
    with running_server(*netplan.slot_net("s3a").astuple(), AENV_HIBERNATE_AFTER="0", **s3) as a:
        c = {"api_key": a.api_key, "api_url": a.url, "sandbox_url": a.url}
        s = Sandbox.create(template="base", timeout=120, **c)  # type: ignore[arg-type]
        s.files.write("/home/user/travel.txt", "across nodes")
        s.commands.run("sleep 4321", background=True)
        snap = s.create_snapshot(name=name)
        _wait_published(a, snap.snapshot_id)
        # A hibernated sandbox goes to the bucket too, and comes back from it.
        s.files.write("/home/user/hib.txt", "slept in s3")
        assert s.pause()
        deadline = time.time() + 60
        while not (hib := _s3_keys(s3_endpoint, bucket, f"nodes/manifests/hib-{s.sandbox_id}")):
            assert time.time() < deadline, "the hibernated sandbox never reached the bucket"
            time.sleep(0.3)
        while list((a.home / "images").glob(f"hib-{s.sandbox_id}*")):
            assert time.time() < deadline, "the node kept its own copy of the memory image"
            time.sleep(0.3)
        for d in (a.home / "cache" / "images").glob(f"hib-{s.sandbox_id}*"):
            shutil.rmtree(d)  # evicted from the node's cache: resume must download it
        again = Sandbox.connect(s.sandbox_id, **c)  # type: ignore[call-overload]
        assert again.files.read("/home/user/hib.txt") == "slept in s3"
        assert "sleep 4321" in again.commands.run("ps aux").stdout
        deadline = time.time() + 60
        while _s3_keys(s3_endpoint, bucket, hib[0]):
            assert time.time() < deadline, "the resumed sandbox stayed in the bucket"
            time.sleep(0.3)
        again.kill()
    # A new node with an empty home and the same bucket.
    with running_server(*netplan.slot_net("s3b").astuple(), **s3) as b:
        assert not (b.home / "images" / snap.snapshot_id).exists()
        c = {"api_key": b.api_key, "api_url": b.url, "sandbox_url": b.url}
        child = Sandbox.create(template=name, timeout=60, **c)  # type: ignore[arg-type]
        assert child.files.read("/home/user/travel.txt") == "across nodes"
        assert "sleep 4321" in child.commands.run("ps aux").stdout
        child.kill()
