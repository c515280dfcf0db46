"""The bench's newer rows against a fake server (httpx MockTransport): the snapshot after
1,000 commands (time and image size, read host-side from a catalog), the populated node
(create/exec with ~100 sandboxes, list_1000), exec at N concurrent; and their targets."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import struct
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench import client, hostdisk, report, scenarios, scenarios_scale, stats
from bench import plan as plan_mod


def _envelope(obj: dict[str, Any], flags: int = 0) -> bytes:
    payload = json.dumps(obj).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


OK_STREAM = (
    _envelope({"event": {"start": {"pid": 1}}})
    + _envelope({"event": {"end": {"exitCode": 0, "exited": True}}})
    + _envelope({}, flags=0x02)
)


class Node:
    """A fake node: create, exec, list, pause (with its body), snapshot, kill."""

    def __init__(self) -> None:
        self.alive: dict[str, dict[str, Any]] = {}
        self.made = 0
        self.snapshots = 0
        self.commands: list[str] = []
        self.pause_bodies: list[dict[str, Any]] = []
        self.list_limits: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        if scenarios.PROBE_ID in path:
            return httpx.Response(404, json={"code": 404, "message": "sandbox not found"})
        if path == "/v2/sandboxes" and method == "POST":
            sid = f"sbx{self.made}"
            self.made += 1
            body = json.loads(request.content)
            self.alive[sid] = {"memoryMB": body.get("memoryMB"), "state": "running"}
            return httpx.Response(201, json={"sandboxID": sid, "envdAccessToken": "tok"})
        if path == "/v2/sandboxes" and method == "GET":
            self.list_limits.append(request.url.params.get("limit", ""))
            return httpx.Response(
                200, json=[{"sandboxID": s, "state": v["state"]} for s, v in self.alive.items()]
            )
        if path == "/process.Process/Start":
            self.commands.append(json.loads(request.content[5:])["process"]["args"][-1])
            return httpx.Response(200, content=OK_STREAM)
        if path.endswith("/pause"):
            body = json.loads(request.content) if request.content else {}
            self.pause_bodies.append(body)
            self.alive[path.split("/")[2]]["state"] = "paused"
            return httpx.Response(204)
        if path.endswith("/snapshots") and method == "POST":
            sid = f"snap{self.snapshots}"
            self.snapshots += 1
            return httpx.Response(
                201, json={"snapshotID": sid}, headers={"Server-Timing": "checkpoint;dur=4"}
            )
        if method == "DELETE" and path.startswith("/templates/"):
            return httpx.Response(204)
        if method == "DELETE" and path.startswith("/sandboxes/"):
            self.alive.pop(path.rsplit("/", 1)[1], None)
            return httpx.Response(204)
        return httpx.Response(404, json={"code": 404, "message": f"no route for {method} {path}"})


def _rows(
    node: Node, plan: plan_mod.Plan, home: Path | None = None
) -> tuple[scenarios.ServerRows, stats.Results, client.Api]:
    api = client.Api("http://fake", "key", transport=httpx.MockTransport(node))
    res = stats.Results()
    rows = scenarios.ServerRows(
        api, res, plan, plan_mod.NullProgress(), want=lambda _r: True, local=False, home=home
    )
    return rows, res, api


def _catalog(home: Path, images: dict[str, tuple[str, int]]) -> None:
    """A catalog like the server's (table `templates`, `doc` JSON) and image directories."""
    conn = sqlite3.connect(home / "catalog.db")
    conn.execute("CREATE TABLE templates (id TEXT PRIMARY KEY, doc TEXT NOT NULL)")
    for snap, (checkpoint, size) in images.items():
        conn.execute(
            "INSERT INTO templates VALUES (?, ?)",
            (snap, json.dumps({"kind": "snapshot", "checkpoint": checkpoint})),
        )
        d = home / "images" / checkpoint
        d.mkdir(parents=True)
        (d / "checkpoint.img").write_bytes(b"\1" * size)
        (d / "pages.meta").write_bytes(b"\0" * 1024)
    conn.commit()
    conn.close()


async def test_snapshot_after_cmds_time_and_size(tmp_path: Path) -> None:
    # Samples alternate: the fresh sandbox (baseline) first, then the one that ran commands.
    mib = 1 << 20
    _catalog(
        tmp_path,
        {
            "snap0": ("c0", 10 * mib),
            "snap1": ("c1", 11 * mib),
            "snap2": ("c2", 10 * mib),
            "snap3": ("c3", 13 * mib),
        },
    )
    node = Node()
    plan = dataclasses.replace(plan_mod.Plan.quick(), cmds_snapshot=2, cmds=1000, cmds_envd=3)
    rows, res, api = _rows(node, plan, home=tmp_path)
    await rows.cmds_snapshot()
    await rows.drain()
    await api.aclose()

    doc = res.document({})
    ours, base = doc["results"], doc["baseline"]
    assert ours["snapshot_after_1000_cmds"]["n"] == 2 and base["snapshot_after_1000_cmds"]["n"] == 2
    assert base["snapshot_after_1000_cmds_mib"]["p50"] == pytest.approx(10.0, abs=0.01)
    assert ours["snapshot_after_1000_cmds_mib"]["p50"] == pytest.approx(12.0, abs=0.01)
    assert doc["stages"]["snapshot_after_1000_cmds"]["checkpoint"] == 4.0
    assert "cmds_in_sandbox" in doc["stages"]["snapshot_after_1000_cmds"]
    # One command ran the 1,000 processes (quick: forked subshells), then 3 envd commands.
    loops = [c for c in node.commands if "seq 1000" in c]
    assert len(loops) == 1 and "/proc/$BASHPID/stat" in loops[0]
    assert node.commands.count("cat /proc/self/stat >/dev/null") == 3
    assert "fresh sandbox" in ours["snapshot_after_1000_cmds"]["note"]
    # 12/10 = 1.2: just within the target; the sandboxes are gone.
    row = report.ROW_BY_NAME["snapshot_after_1000_cmds_mib"]
    assert row.target is not None
    assert row.target.check(
        ours["snapshot_after_1000_cmds_mib"], base["snapshot_after_1000_cmds_mib"]
    )
    assert not node.alive


async def test_snapshot_after_cmds_without_a_home() -> None:
    node = Node()
    rows, res, api = _rows(node, plan_mod.Plan.quick(), home=None)
    await rows.cmds_snapshot()
    await rows.drain()
    await api.aclose()
    r = res.document({})["results"]
    assert r["snapshot_after_1000_cmds"]["n"] == 1
    assert r["snapshot_after_1000_cmds_mib"]["missing"] is True
    assert "host-side" in r["snapshot_after_1000_cmds_mib"]["note"]


def test_cmds_command_forms() -> None:
    assert scenarios.cmds_command(1000) == (
        "for i in $(seq 1000); do sh -c 'cat /proc/$$/stat >/dev/null'; done"
    )
    assert "( read -r _ < /proc/$BASHPID/stat )" in scenarios.cmds_command(5, "fork")
    assert plan_mod.Plan().cmds_form == "exec" and plan_mod.Plan.quick().cmds_form == "fork"


async def test_populated_node_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scenarios_scale, "POOL_REFILL_WAIT", 0.0)
    node = Node()
    plan = dataclasses.replace(
        plan_mod.Plan.quick(),
        idle_sandboxes=5,
        list_sandboxes=12,
        populated_create=2,
        populated_exec=3,
        list=2,
        idle_wait=0.0,
    )
    rows, res, api = _rows(node, plan)
    await rows.populated_rows()
    await rows.drain()
    await api.aclose()

    doc = res.document({})
    ours, base = doc["results"], doc["baseline"]
    for name, n in (
        ("create_to_first_exec_with_100", 2),
        ("exec_roundtrip_with_100", 3),
        ("list_1000", 2),
    ):
        assert ours[name]["n"] == n and base[name]["n"] == n, name
    assert "with 5 sandboxes on the node (4 idle" in ours["exec_roundtrip_with_100"]["note"]
    assert "12 sandboxes listed (quick mode: fewer)" in ours["list_1000"]["note"]
    # The idle ones were 128 MiB; all 12 made for the list were paused files-only, and
    # every list asked for one page of 1,000.
    assert node.pause_bodies.count({"memory": False}) == 12
    assert set(node.list_limits) == {"1000"}
    assert not node.alive  # all killed


async def test_exec_concurrent_rows() -> None:
    node = Node()
    plan = dataclasses.replace(
        plan_mod.Plan.quick(), concurrent_50_rounds=0, exec_concurrent_rounds=3
    )
    rows, res, api = _rows(node, plan)
    rows.want = lambda r: r in ("concurrent_create_10", "exec_concurrent_10")
    await rows.concurrent_rows()
    await api.aclose()
    r = res.document({})["results"]
    assert r["concurrent_create_10"]["n"] == 10
    assert r["exec_concurrent_10"]["n"] == 30  # 3 rounds × 10 sandboxes, after a warm-up
    assert r["exec_concurrent_50"]["n"] == 0
    assert not node.alive


def test_new_row_targets() -> None:
    def check(name: str, ours: float, base: float | None = None) -> bool | None:
        row = report.ROW_BY_NAME[name]
        assert row.target is not None
        return row.target.check({"p50": ours}, {"p50": base} if base is not None else None)

    for name in (
        "snapshot_after_1000_cmds",
        "snapshot_after_1000_cmds_mib",
        "create_to_first_exec_with_100",
        "exec_roundtrip_with_100",
    ):
        assert check(name, 119.0, 100.0) is True, name
        assert check(name, 121.0, 100.0) is False, name
        assert check(name, 50.0) is None, name  # no reference: undecided
    assert check("list_1000", 49.0) is True
    assert check("list_1000", 51.0) is False
    assert report.ROW_BY_NAME["list_1000"].target.describe("ms") == "p50 ≤ 50 ms"  # type: ignore[union-attr]
    table = {
        cells[0]: cells
        for cells in report.table_rows(
            {"results": {"list_1000": {"p50": 60.0, "p95": 70.0, "n": 5}}}
        )
    }
    assert table["list_1000"][7] == "✘"
    for name in ("exec_concurrent_10", "exec_concurrent_50", "snapshot_after_1000_cmds_mib"):
        assert name in report.REQUIRED


def test_hostdisk(tmp_path: Path) -> None:
    assert hostdisk.snapshot_image_mib(tmp_path, "snap0") is None  # no catalog
    _catalog(tmp_path, {"snap0": ("c0", 2 << 20)})
    img = tmp_path / "images" / "c0"
    os.link(img / "checkpoint.img", img / "again.img")  # a hard link counts once
    assert hostdisk.checkpoint_of(tmp_path, "snap0") == "c0"
    assert hostdisk.checkpoint_of(tmp_path, "nope") is None
    assert hostdisk.snapshot_image_mib(tmp_path, "snap0") == pytest.approx(2 + 1 / 1024)
    assert hostdisk.dir_bytes(tmp_path / "missing") is None
