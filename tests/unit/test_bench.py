"""The benchmark harness's pure parts: percentiles, Server-Timing, the result document, the
Markdown report, and a server without pause/snapshot/fork (a fake httpx transport)."""

from __future__ import annotations

import json
import struct
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.cli.bench import select_rows
from aenv.cli.errors import CliError
from bench import client, harness, hostproc, report, scenarios, stats
from bench import plan as plan_mod

# -- percentiles -------------------------------------------------------------------------------


def test_percentile_interpolates_between_ranks() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert stats.percentile(xs, 0) == 1.0
    assert stats.percentile(xs, 100) == 4.0
    assert stats.percentile(xs, 50) == pytest.approx(2.5)
    assert stats.percentile(xs, 95) == pytest.approx(3.85)  # rank 2.85
    assert stats.percentile([7.0], 99) == 7.0
    assert stats.percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_percentile_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        stats.percentile([], 50)
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)


def test_summarize() -> None:
    s = stats.summarize([10.0, 20.0, 30.0, 40.0, 50.0])
    assert s == {"p50": 30.0, "p95": 48.0, "p99": 49.6, "n": 5}
    assert stats.summarize([]) == {"p50": None, "p95": None, "p99": None, "n": 0}


# -- Server-Timing -----------------------------------------------------------------------------


def test_parse_server_timing() -> None:
    parse = stats.parse_server_timing
    assert parse("boot;dur=243.6, envd;dur=366.8") == {"boot": 243.6, "envd": 366.8}
    assert parse('restore;desc="runsc restore";dur=12') == {"restore": 12.0}
    assert parse("a;dur=1, a;dur=2.5") == {"a": 3.5}  # a repeated stage adds up
    assert parse("cache;desc=hit, x;dur=oops, ;dur=3, bad name;dur=1") == {}
    assert parse(None) == {}
    assert parse("") == {}


# -- the result document ----------------------------------------------------------------------


def _results() -> Any:
    r = stats.Results()
    for v in (100.0, 110.0, 120.0):
        r.add("create_to_first_exec", v, {"boot": v / 2, "envd": 10.0})
        r.add("create_to_first_exec", v / 2, baseline=True)
    r.add("exec_roundtrip", 5.0)
    r.add("snapshot", 130.0)
    r.add("snapshot", 100.0, baseline=True)
    r.add("idle_sandbox_rss_mib", 70.0)
    r.missing(["fork_1", "fork_4"], "fork: not available on this server (HTTP 404: no route)")
    r.note("exec_roundtrip", "1 of 2 samples failed")
    return r


def test_document_shape() -> None:
    doc = _results().document({"cpu": "x", "cores": 2}, {"config": {"mode": "quick"}})
    assert set(doc) >= {"machine", "results", "baseline", "stages", "config"}
    assert set(report.REQUIRED) <= set(doc["results"])
    for name, row in doc["results"].items():
        assert {"p50", "p95", "p99", "n"} <= set(row), name
    assert doc["results"]["create_to_first_exec"]["p50"] == 110.0
    assert doc["results"]["create_to_first_exec"]["n"] == 3
    assert doc["stages"]["create_to_first_exec"] == {"boot": 55.0, "envd": 10.0}
    assert doc["baseline"]["create_to_first_exec"]["p50"] == 55.0
    fork = doc["results"]["fork_1"]
    assert fork["n"] == 0 and fork["p50"] is None and fork["missing"] is True
    assert "no route" in fork["note"]
    assert doc["results"]["exec_roundtrip"]["note"] == "1 of 2 samples failed"
    assert doc["results"]["pause"]["note"] == "not measured in this run"
    json.dumps(doc)  # serialisable as is


def test_write_results(tmp_path: Path) -> None:
    doc = _results().document({"cpu": "x"})
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    latest, dated = harness.write_results(doc, tmp_path / "results", when)
    assert latest is not None and latest.name == "latest.json"
    assert dated.name == "2026-01-02T03-04-05.json"
    assert json.loads(latest.read_text()) == json.loads(dated.read_text()) == doc
    # a partial run leaves latest.json alone
    later = datetime(2026, 1, 2, 3, 9, 9, tzinfo=UTC)
    none, dated2 = harness.write_results(
        {"partial": True}, tmp_path / "results", later, latest=False
    )
    assert none is None and json.loads(dated2.read_text()) == {"partial": True}
    assert json.loads(latest.read_text()) == doc


# -- the report --------------------------------------------------------------------------------


def test_render_markdown() -> None:
    doc = _results().document(
        {
            "cpu": "Xeon",
            "cores": 2,
            "memory_gb": 23.5,
            "kernel": "6.1",
            "runtime": "gVisor",
            "runtime_version": "x",
        },
        {"config": {"mode": "quick"}},
    )
    md = report.render_markdown(doc)
    lines = md.splitlines()
    assert lines[0].startswith("Machine: Xeon, 2 cores, 23.5 GB")
    assert "| row | ours p50 | ours p95 | n | baseline p50 | ours/baseline | target | met |" in md
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    create = [c.strip() for c in rows["create_to_first_exec"].split("|")[1:-1]]
    assert create == [
        "create_to_first_exec",
        "110 ms",
        "119 ms",
        "3",
        "55.0 ms",
        "2.00×",
        "p50 ≤ exec_roundtrip + 30 ms",  # 5 + 30
        "✘",
    ]
    exec_ = [c.strip() for c in rows["exec_roundtrip"].split("|")[1:-1]]
    # Relative to a row this run did not measure: undecided.
    assert exec_[-2:] == ["p50 ≤ spawn_in_sandbox + 10 ms", ""]
    snap = [c.strip() for c in rows["snapshot"].split("|")[1:-1]]
    assert snap[5:] == ["1.30×", "p50 ≤ 1.5× baseline", "✔"]
    rss = [c.strip() for c in rows["idle_sandbox_rss_mib"].split("|")[1:-1]]
    assert rss[1] == "70.0 MiB" and rss[-1] == ""
    fork16 = [c.strip() for c in rows["fork_16"].split("|")[1:-1]]
    assert fork16[1] == "–" and fork16[6] == "p50 ≤ 1× baseline and ≤ 3 s" and fork16[7] == ""
    assert "- `fork_1`: fork: not available on this server (HTTP 404: no route)" in md


def test_targets() -> None:
    t = report.Target("p95", limit=150)
    assert t.check({"p95": 150.0}, None) is True
    assert t.check({"p95": 151.0}, None) is False
    assert t.check({"p95": None}, None) is None
    r = report.Target("p50", ratio=1.2)
    assert r.check({"p50": 120.0}, {"p50": 100.0}) is True
    assert r.check({"p50": 121.0}, {"p50": 100.0}) is False
    assert r.check({"p50": 121.0}, None) is None
    # Relative to another row of the same run, and several bounds at once.
    rel = report.Target("p50", row="spawn_in_sandbox", plus=10)
    assert rel.check({"p50": 40.0}, None, {"spawn_in_sandbox": {"p50": 30.0}}) is True
    assert rel.check({"p50": 41.0}, None, {"spawn_in_sandbox": {"p50": 30.0}}) is False
    assert rel.check({"p50": 41.0}, None, {}) is None
    # A multiple of another row (plus a constant).
    times = report.Target("p50", row="resume_from_disk", times=1.2)
    assert times.check({"p50": 120.0}, None, {"resume_from_disk": {"p50": 100.0}}) is True
    assert times.check({"p50": 121.0}, None, {"resume_from_disk": {"p50": 100.0}}) is False
    assert times.check({"p50": 100.0}, None, {}) is None  # not judged without that row
    assert times.describe("ms") == "p50 ≤ 1.2× resume_from_disk"
    both_rel = report.Target("p50", row="resume_from_disk", times=2, plus=5)
    assert both_rel.bound(None, {"resume_from_disk": {"p50": 10.0}}) == 25.0
    assert both_rel.describe("ms") == "p50 ≤ 2× resume_from_disk + 5 ms"
    both = report.Target("p50", 3000, ratio=1.0)
    assert both.check({"p50": 2500.0}, {"p50": 2600.0}) is True
    assert both.check({"p50": 2700.0}, {"p50": 2600.0}) is False  # over the baseline
    assert both.check({"p50": 3100.0}, {"p50": 4000.0}) is False  # over 3 s
    assert both.describe("ms") == "p50 ≤ 1× baseline and ≤ 3 s"


def test_report_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "latest.json"
    path.write_text(json.dumps(_results().document({"cpu": "x"})))
    assert report.main(["report.py", str(path)]) == 0
    assert "| create_to_first_exec |" in capsys.readouterr().out
    assert report.main(["report.py", str(tmp_path / "nope.json")]) == 1


# -- helpers of the scenarios ------------------------------------------------------------------


def test_reports_hibernated() -> None:
    f = scenarios.reports_hibernated
    assert f({"state": "paused", "pauseTier": "hibernated"})
    assert f({"state": "paused", "lifecycle": {"hibernated": True}})
    assert not f({"state": "paused", "hibernated": False, "lifecycle": {"onTimeout": "kill"}})
    assert not f({"state": "paused"})


def test_dirty_command_writes_the_size() -> None:
    cmd = scenarios.dirty_command(1024)
    assert "head -c 64M /dev/urandom > f0" in cmd and "$(seq 15)" in cmd  # 16 × 64 MiB


async def test_sample_loop_gives_up_and_notes() -> None:
    res = stats.Results()
    calls = 0

    async def fails(_i: int) -> tuple[float, dict[str, float]]:
        nonlocal calls
        calls += 1
        raise client.BenchError("boom")

    ok = await scenarios.sample_loop(res, ["pause"], 10, fails, plan_mod.NullProgress())
    assert ok is False and calls == 3
    note = res.series("pause").summary()["note"]
    assert "failed: boom" in note and "stopped after 3 of 10 samples failed" in note


def test_hostproc_scan(tmp_path: Path) -> None:
    def proc(pid: int, argv: list[str], ppid: int = 1, state: str = "S") -> None:
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + (b"\0" if argv else b""))
        (d / "stat").write_text(f"{pid} (exe) {state} {ppid} 0 0")

    proc(10, ["runsc-sandbox", "--root=/x", "boot", "sbxA-1234"])
    proc(11, ["runsc-gofer", "--log=/h/sandboxes/sbxA/sbxA-1234/runsc.log", "gofer"])
    proc(12, [], ppid=10)  # a systrap stub
    proc(20, ["runsc-sandbox", "boot", "sbxB-99"])
    proc(30, ["python3", "sbxA"])  # not runsc
    (tmp_path / "self").mkdir()
    found = hostproc.scan(["sbxA", "sbxC"], proc=tmp_path)
    assert found["sbxA"].sentry == [10] and found["sbxA"].gofer == [11]
    assert found["sbxA"].stubs == [12]
    assert not found["sbxC"]


# -- a server without pause, snapshot and fork -------------------------------------------------


def _envelope(obj: dict[str, Any], flags: int = 0) -> bytes:
    payload = json.dumps(obj).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


class FakeServer:
    """Create, exec, files, kill and list work; pause is a 404 "no route", snapshots a 405
    and fork a 501, as on a server where those are not implemented yet."""

    def __init__(self) -> None:
        self.made: list[str] = []
        self.killed: list[str] = []
        self.files: dict[str, bytes] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        if path == "/v2/sandboxes" and method == "POST":
            sid = f"sbx{len(self.made)}"
            self.made.append(sid)
            return httpx.Response(
                201,
                json={"sandboxID": sid, "envdAccessToken": "tok"},
                headers={"Server-Timing": "boot;dur=5.0, envd;dur=2.0"},
            )
        if path == "/v2/sandboxes" and method == "GET":
            return httpx.Response(200, json=[])
        if path == "/process.Process/Start":
            assert request.headers["E2b-Sandbox-Id"].startswith("sbx")
            assert request.headers["X-Access-Token"] == "tok"
            body = request.content
            assert json.loads(body[5:])["process"]["cmd"] == "/bin/bash"
            stream = (
                _envelope({"event": {"start": {"pid": 1}}})
                + _envelope({"event": {"end": {"exitCode": 0, "exited": True}}})
                + _envelope({}, flags=0x02)
            )
            return httpx.Response(
                200, content=stream, headers={"content-type": "application/connect+json"}
            )
        if path == "/files":
            key = request.url.params["path"]
            if method == "POST":
                self.files[key] = request.content
                return httpx.Response(200, json=[{"path": key, "name": "x", "type": "file"}])
            if key not in self.files:
                return httpx.Response(404, json={"code": 404, "message": f"{key} not found"})
            return httpx.Response(200, content=self.files[key])
        if method == "DELETE" and path.startswith("/sandboxes/"):
            self.killed.append(path.rsplit("/", 1)[1])
            return httpx.Response(204)
        if path.endswith("/pause"):
            return httpx.Response(404, json={"code": 404, "message": f"no route for POST {path}"})
        if path.endswith("/snapshots"):
            return httpx.Response(405, json={"code": 405, "message": "Method Not Allowed"})
        if path.endswith("/fork"):
            return httpx.Response(501, json={"code": 501, "message": "fork is not implemented"})
        return httpx.Response(404, json={"code": 404, "message": f"no route for {method} {path}"})


async def test_missing_endpoints_are_recorded_not_fatal() -> None:
    fake = FakeServer()
    api = client.Api(
        "http://fake", "key", transport=httpx.MockTransport(fake), metadata={"aenv-bench": "t"}
    )
    res = stats.Results()
    plan = plan_mod.Plan.quick()
    rows = scenarios.ServerRows(
        api, res, plan, plan_mod.NullProgress(), want=lambda _r: True, local=False
    )
    await rows.create_rows("create_to_first_exec", 2)
    await rows.running_sandbox_rows()
    await rows.dirty_snapshot()
    await rows.fork_rows()
    await rows.hibernate_rows()
    await rows.drain()
    assert await api.cleanup() == []
    await api.aclose()

    doc = res.document({})
    r = doc["results"]
    assert r["create_to_first_exec"]["n"] == 2
    assert doc["stages"]["create_to_first_exec"]["boot"] == 5.0
    assert "http_create" in doc["stages"]["create_to_first_exec"]
    assert r["exec_roundtrip"]["n"] == plan.exec
    assert r["file_write_1mib"]["n"] == plan.files and r["file_read_1mib"]["n"] == plan.files
    for name in ("pause", "resume", "hibernate", "resume_from_disk"):
        assert r[name]["missing"] is True and "404" in r[name]["note"], name
    assert r["snapshot"]["missing"] is True and "405" in r["snapshot"]["note"]
    assert r["snapshot_dirty_1gib"]["missing"] is True
    for name in ("fork_1", "fork_4", "fork_16"):
        assert r[name]["missing"] is True and "501" in r[name]["note"], name
    # Every sandbox the bench made was removed by id.
    assert sorted(fake.killed) == sorted(fake.made)
    assert not api.sandboxes


async def test_exec_failure_is_a_bench_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        stream = _envelope({"event": {"end": {"exitCode": 3}}}) + _envelope({}, flags=0x02)
        return httpx.Response(200, content=stream)

    api = client.Api("http://fake", "key", transport=httpx.MockTransport(handler))
    with pytest.raises(client.BenchError, match="exit code 3"):
        await api.run(client.Sbx("sbx", None), "false")
    await api.aclose()


class FullFakeServer(FakeServer):
    """Every operation works, except that deleting a snapshot answers 409."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        if scenarios.PROBE_ID in path:  # the route probe: the route exists, the sandbox not
            return httpx.Response(404, json={"code": 404, "message": "sandbox not found"})
        if path.endswith("/pause"):
            return httpx.Response(204)
        if path.endswith("/connect"):
            return httpx.Response(201, json={"sandboxID": path.split("/")[3]})
        if path.endswith("/snapshots") and method == "POST":
            return httpx.Response(
                201, json={"snapshotID": "snap1"}, headers={"Server-Timing": "checkpoint;dur=7"}
            )
        if path.startswith("/templates/") and method == "DELETE":
            return httpx.Response(409, json={"code": 409, "message": "in use"})
        if path.endswith("/fork"):
            count = json.loads(request.content)["count"]
            children = []
            for _ in range(count):
                sid = f"sbx{len(self.made)}"
                self.made.append(sid)
                children.append({"sandbox": {"sandboxID": sid, "envdAccessToken": "tok"}})
            return httpx.Response(201, json=children)
        return super().__call__(request)


async def test_fork_and_snapshot_rows_with_a_failing_delete() -> None:
    fake = FullFakeServer()
    api = client.Api("http://fake", "key", transport=httpx.MockTransport(fake))
    res = stats.Results()
    plan = plan_mod.Plan.quick()
    rows = scenarios.ServerRows(
        api, res, plan, plan_mod.NullProgress(), want=lambda _r: True, local=False
    )
    await rows.running_sandbox_rows()
    await rows.fork_rows()
    await rows.drain()
    failed = await api.cleanup()
    await api.aclose()

    r = res.document({})["results"]
    assert r["pause"]["n"] == plan.pause and r["resume"]["n"] == plan.pause
    assert r["snapshot"]["n"] == plan.snapshot  # the time counts even if the delete fails
    assert "deleting the snapshot failed" in r["snapshot"]["note"]
    assert res.document({})["stages"]["snapshot"] == {"checkpoint": 7.0}
    assert (r["fork_1"]["n"], r["fork_4"]["n"], r["fork_16"]["n"]) == (
        plan.fork_1,
        plan.fork_4,
        plan.fork_16,
    )
    assert failed == ["delete snapshot snap1: HTTP 409: in use"]
    assert sorted(fake.killed) == sorted(fake.made)


def test_only_takes_row_names_and_patterns() -> None:
    qemu = select_rows("qemu_*", report.REQUIRED)
    assert "qemu_fork_1" in qemu and "qemu_idle_sandbox_mc" in qemu
    assert all(r.startswith("qemu_") for r in qemu)
    assert select_rows(" exec_roundtrip , qemu_pause", report.REQUIRED) == {
        "exec_roundtrip",
        "qemu_pause",
    }
    with pytest.raises(CliError, match="unknown rows: exec_rountrip, nope_"):
        select_rows("exec_rountrip,qemu_*,nope_*", report.REQUIRED)
    with pytest.raises(CliError, match="names no rows"):
        select_rows(" , ", report.REQUIRED)
