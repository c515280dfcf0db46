"""The bench's fork-tree rows (diff_10_of_1gib, apply_10_of_1gib, rollback) against a fake
server (httpx MockTransport), their targets, and `--only rollback` bringing resume_from_disk."""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import httpx

from bench import client, harness, report, scenarios, scenarios_forktree, stats
from bench import plan as plan_mod

TREE = scenarios_forktree.TREE_DIR


def _envelope(obj: dict[str, Any], flags: int = 0) -> bytes:
    payload = json.dumps(obj).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


OK_STREAM = (
    _envelope({"event": {"start": {"pid": 1}}})
    + _envelope({"event": {"end": {"exitCode": 0, "exited": True}}})
    + _envelope({}, flags=0x02)
)


def _changes(n: int) -> list[dict[str, Any]]:
    return [
        {"path": f"{TREE}/f{i:04d}", "change": "changed", "type": "file", "size": 1, "mode": 420}
        for i in range(n)
    ] + [{"path": "/root/.bash_history", "change": "added", "type": "file", "size": 1, "mode": 0}]


class Node:
    """A fake node: create, exec, fork, snapshot, diff, apply, rollback, kill."""

    def __init__(self, changed: int = 10) -> None:
        self.alive: set[str] = set()
        self.made = 0
        self.snapshots: dict[str, str] = {}
        self.deleted: list[str] = []
        self.commands: list[str] = []
        self.calls: list[str] = []
        self.changed = changed

    def _new(self) -> str:
        sid = f"sbx{self.made}"
        self.made += 1
        self.alive.add(sid)
        return sid

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        if scenarios.PROBE_ID in path:
            return httpx.Response(404, json={"code": 404, "message": "sandbox not found"})
        if path == "/v2/sandboxes" and method == "POST":
            return httpx.Response(201, json={"sandboxID": self._new(), "envdAccessToken": "t"})
        if path == "/process.Process/Start":
            self.commands.append(json.loads(request.content[5:])["process"]["args"][-1])
            return httpx.Response(200, content=OK_STREAM)
        sid = path.split("/")[2] if path.startswith("/sandboxes/") else ""
        body = json.loads(request.content) if request.content else {}
        if path.endswith("/fork"):
            self.calls.append(f"fork {sid}")
            assert body["count"] == 1
            return httpx.Response(201, json=[{"sandbox": {"sandboxID": self._new()}}])
        if path.endswith("/snapshots") and method == "POST":
            snap = f"snap{len(self.snapshots)}"
            self.snapshots[snap] = sid
            self.calls.append(f"snapshot {sid}")
            return httpx.Response(201, json={"snapshotID": snap})
        if path.endswith("/diff"):
            self.calls.append(f"diff {sid}")
            return httpx.Response(200, json=_changes(self.changed))
        if path.endswith("/apply"):
            self.calls.append(f"apply {sid} from {body['from']} {body['strategy']}")
            return httpx.Response(200, json={"applied": _changes(self.changed), "conflicts": []})
        if path.endswith("/rollback"):
            assert self.snapshots[body["snapshotID"]] == sid
            self.calls.append(f"rollback {sid}")
            return httpx.Response(
                200,
                json={"sandboxID": sid, "snapshotID": body["snapshotID"]},
                headers={"Server-Timing": "restore;dur=7"},
            )
        if method == "DELETE" and path.startswith("/templates/"):
            self.deleted.append(path.rsplit("/", 1)[1])
            return httpx.Response(204)
        if method == "DELETE" and path.startswith("/sandboxes/"):
            self.alive.discard(sid)
            return httpx.Response(204)
        return httpx.Response(404, json={"code": 404, "message": f"no route for {method} {path}"})


async def _run(node: Node, plan: plan_mod.Plan) -> dict[str, Any]:
    api = client.Api("http://fake", "key", transport=httpx.MockTransport(node))
    res = stats.Results()
    rows = scenarios.ServerRows(
        api, res, plan, plan_mod.NullProgress(), want=lambda _r: True, local=False
    )
    await rows.diff_apply_rows()
    await rows.rollback_row()
    await rows.drain()
    await api.aclose()
    return res.document({})


async def test_diff_apply_and_rollback_rows() -> None:
    node = Node()
    plan = dataclasses.replace(plan_mod.Plan.quick(), forktree=2, rollback=3)
    doc = await _run(node, plan)
    ours, base = doc["results"], doc["baseline"]
    for row in ("diff_10_of_1gib", "apply_10_of_1gib"):
        assert ours[row]["n"] == 2 and base[row]["n"] == 2, ours[row]
    assert ours["rollback"]["n"] == 3
    assert doc["stages"]["rollback"]["restore"] == 7.0
    # The parent (sbx0) wrote the tree once; per sample: fork, the child's snapshot, its
    # diff, its changes applied to the parent.
    assert sum("range(0, 1024)" in c for c in node.commands) == 1
    assert sum("range(0, 10)" in c for c in node.commands) == 2
    assert node.calls[:4] == [
        "fork sbx0",
        "snapshot sbx1",
        "diff sbx1",
        "apply sbx0 from sbx1 theirs",
    ]
    assert node.calls.count("rollback sbx3") == 3
    # Everything made is gone: sandboxes killed, snapshots deleted.
    assert not node.alive
    assert sorted(node.deleted) == sorted(node.snapshots)


async def test_diff_that_misses_files_fails_the_sample() -> None:
    node = Node(changed=9)
    doc = await _run(node, dataclasses.replace(plan_mod.Plan.quick(), rollback=1))
    diff = doc["results"]["diff_10_of_1gib"]
    assert diff["n"] == 0 and "9 changed files" in diff["note"]
    assert not node.alive


def test_forktree_targets() -> None:
    rb = report.ROW_BY_NAME["rollback"].target
    assert rb is not None
    assert rb.describe("ms") == "p50 ≤ 1.2× resume_from_disk"
    assert rb.check({"p50": 110.0}, None, {"resume_from_disk": {"p50": 100.0}}) is True
    assert rb.check({"p50": 130.0}, None, {"resume_from_disk": {"p50": 100.0}}) is False
    assert rb.check({"p50": 110.0}, None, {}) is None
    for name in ("diff_10_of_1gib", "apply_10_of_1gib"):
        t = report.ROW_BY_NAME[name].target
        assert t is not None and t.check({"p50": 150.0}, {"p50": 100.0}) is True
        assert t.check({"p50": 151.0}, {"p50": 100.0}) is False
    assert set(scenarios_forktree.FORKTREE_ROWS) <= set(harness.MAIN_ROWS)


def test_only_rollback_brings_resume_from_disk() -> None:
    run = harness.Run(
        harness.Options(only={"rollback"}), plan_mod.Plan.quick(), plan_mod.NullProgress()
    )
    assert run.want("rollback") and run.want("resume_from_disk")
    assert not run.want("hibernate") and not run.want("diff_10_of_1gib")
