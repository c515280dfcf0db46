"""Lineage (orchestrator/lineage.py, routes/lineage.py) over a real node on the fake runtime:
what `GET /sandboxes/{id}` and `GET /sandboxes/{id}/lineage` show through fork-of-fork,
create from a snapshot, pause and resume, a restart, and a killed ancestor."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from aenv.domain import (
    Lineage,
    SandboxRecord,
    SandboxState,
    TemplateKind,
    TemplateRecord,
    record_from_json,
    record_to_json,
)
from aenv.orchestrator import lineage_tree
from tests.node_harness import Harness, started
from tests.unit.api_node import running


async def _fork(client: httpx.AsyncClient, sid: str, count: int = 1) -> list[str]:
    r = await client.post(f"/sandboxes/{sid}/fork", json={"count": count})
    assert r.status_code == 201, r.text
    return [item["sandbox"]["sandboxID"] for item in r.json()]


async def _tree(client: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    r = await client.get(f"/sandboxes/{sid}/lineage")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _ids(items: list[dict[str, Any]]) -> list[str]:
    return [i["sandboxID"] for i in items]


async def test_a_template_sandbox_has_only_its_template(
    client: httpx.AsyncClient, node: Harness
) -> None:
    rec = await running(node)
    info = (await client.get(f"/sandboxes/{rec.sandbox_id}")).json()
    assert info["lineage"] == {"templateID": rec.template_id}
    assert await _tree(client, rec.sandbox_id) == {
        "sandboxID": rec.sandbox_id,
        "lineage": {"templateID": rec.template_id},
        "ancestors": [],
        "descendants": [],
    }
    assert (await client.get("/sandboxes/nope/lineage")).status_code == 404


async def test_fork_of_fork_and_a_killed_ancestor(client: httpx.AsyncClient, node: Harness) -> None:
    root = (await running(node)).sandbox_id
    kid, kid2 = await _fork(client, root, 2)
    (grandkid,) = await _fork(client, kid)
    info = (await client.get(f"/sandboxes/{grandkid}")).json()
    lin = info["lineage"]
    assert lin["parentID"] == kid and lin["forkPoint"] and lin["templateID"] == "base"
    assert info["templateID"] == "base"  # E2B's field is unchanged

    tree = await _tree(client, grandkid)
    assert _ids(tree["ancestors"]) == [root, kid]  # oldest first
    assert [a["state"] for a in tree["ancestors"]] == ["running", "running"]
    assert tree["ancestors"][1]["lineage"]["parentID"] == root

    down = (await _tree(client, root))["descendants"]
    assert sorted(_ids(down)) == sorted([kid, kid2])
    (via_kid,) = [d for d in down if d["sandboxID"] == kid]
    assert _ids(via_kid["children"]) == [grandkid]

    # A killed ancestor: its id only, as the child kept it; the walk stops there.
    assert (await client.delete(f"/sandboxes/{kid}")).status_code == 204
    tree = await _tree(client, grandkid)
    assert tree["ancestors"] == [{"sandboxID": kid, "state": "killed"}]
    # ... and it is no longer a descendant of the root (nor its child, through it).
    assert _ids((await _tree(client, root))["descendants"]) == [kid2]


async def test_from_a_snapshot_and_through_pause(client: httpx.AsyncClient, node: Harness) -> None:
    src = (await running(node)).sandbox_id
    r = await client.post(f"/sandboxes/{src}/snapshots", json={"name": "lin-snap"})
    assert r.status_code == 201, r.text
    snap = r.json()["snapshotID"]
    r = await client.post("/v2/sandboxes", json={"templateID": snap})
    assert r.status_code == 201, r.text
    made = r.json()["sandboxID"]
    want = {"templateID": "base", "snapshotID": snap, "snapshotOf": src}
    assert (await client.get(f"/sandboxes/{made}")).json()["lineage"] == want
    tree = await _tree(client, made)
    assert _ids(tree["ancestors"]) == [src]
    assert _ids((await _tree(client, src))["descendants"]) == [made]

    assert (await client.post(f"/sandboxes/{made}/pause")).status_code == 204
    tree = await _tree(client, src)
    assert tree["descendants"][0]["state"] == "paused"
    assert (await client.post(f"/v2/sandboxes/{made}/connect", json={})).status_code == 201
    assert (await client.get(f"/sandboxes/{made}")).json()["lineage"] == want


async def test_lineage_survives_a_restart(tmp_path: Path) -> None:
    async for h in started(tmp_path):
        parent = await running(h)
        (child,) = await h.orch.forker.fork(parent.sandbox_id, 1, None)
        assert child.sandbox is not None
        kid = child.sandbox.sandbox_id
        h2 = await h.restart()
        await h2.orch.start(timers=False)
        try:
            back = h2.orch.table.get(kid)
            assert back.lineage.parent_id == parent.sandbox_id
            tree = lineage_tree(h2.orch.table, parent.sandbox_id)
            assert [d.sandbox_id for d in tree.descendants] == [kid]
        finally:
            await h2.orch.close()


def test_records_without_lineage_read_as_before() -> None:
    """A record written before lineage: its template, and a fork child's `parent_id`."""
    lin = Lineage(template_id="base", parent_id="iparent", fork_point="ifork")
    doc = json.loads(record_to_json(_record(lin)))
    assert doc["lineage"]["fork_point"] == "ifork"
    assert record_from_json(json.dumps(doc)).lineage == lin
    del doc["lineage"]
    doc["parent_id"] = "iparent"
    assert record_from_json(json.dumps(doc)).lineage == Lineage(
        template_id="base", parent_id="iparent"
    )


def test_a_hibernated_sandbox_moves_with_its_lineage() -> None:
    """Between nodes a hibernated sandbox travels as its record in the repository's
    hibernation document (TemplateRecord.hibernated)."""
    lin = Lineage(template_id="base", snapshot_id="isnap", snapshot_of="isrc")
    hib = TemplateRecord(
        template_id="ihib", kind=TemplateKind.HIBERNATION, layers=[], hibernated=_record(lin)
    )
    doc = json.loads(json.dumps(hib.to_doc()))
    back = TemplateRecord.from_doc("ihib", doc).hibernated
    assert back is not None and back.lineage == lin


def _record(lineage: Lineage) -> SandboxRecord:
    now = datetime.now(UTC)
    return SandboxRecord(
        sandbox_id="ichild",
        template_id="base",
        alias=None,
        client_id="aenv",
        started_at=now,
        end_at=now,
        cpu_count=1,
        memory_mb=256,
        disk_mb=1024,
        state=SandboxState.RUNNING,
        envd_version="0",
        envd_access_token="t",
        lineage=lineage,
    )


async def test_fork_from_a_named_snapshot_with_count(
    client: httpx.AsyncClient, node: Harness
) -> None:
    """aenv's: a snapshot's id or name in place of a sandbox's in the fork route."""
    src = (await running(node, metadata={"k": "v"})).sandbox_id
    r = await client.post(f"/sandboxes/{src}/snapshots", json={"name": "fork-me"})
    snap = r.json()["snapshotID"]
    for source in (snap, "fork-me"):
        made = await _fork(client, source, 3)
        assert len(set(made)) == 3
        for sid in made:
            lin = (await client.get(f"/sandboxes/{sid}")).json()["lineage"]
            assert lin == {"templateID": "base", "snapshotID": snap, "snapshotOf": src}
    assert len((await _tree(client, src))["descendants"]) == 6
    r = await client.post("/sandboxes/nope/fork", json={"count": 2})
    assert r.status_code == 404
    r = await client.post("/sandboxes/fork-me/fork", json={"count": 0})
    assert r.status_code == 400
