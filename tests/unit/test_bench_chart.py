"""The bench's chart (bench/chart.py): what it draws from a result document, and that it
writes a real PNG, also from `python -m bench.chart`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import chart, harness

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(p50: float, p95: float | None = None, n: int = 3) -> dict[str, Any]:
    return {"p50": p50, "p95": p95 if p95 is not None else p50 * 1.2, "p99": p50 * 1.3, "n": n}


def _doc() -> dict[str, Any]:
    return {
        "machine": {
            "cpu": "Test CPU",
            "cores": 2,
            "memory_gb": 23.5,
            "kernel": "6.1.0",
            "runtime": "gVisor runsc (systrap)",
            "runtime_version": "0.0~20240729.0",
        },
        "results": {
            "create_to_first_exec": _row(130.0, 180.0),
            "exec_roundtrip": _row(8.0, 12.0),
            "snapshot": _row(500.0),
            "concurrent_create_10": _row(900.0, 1500.0, 10),
            "concurrent_create_50": _row(4000.0, 9000.0, 50),
            "exec_concurrent_10": _row(40.0, 90.0, 20),
            "exec_concurrent_50": _row(200.0, 400.0, 100),
            "snapshot_after_1000_cmds": _row(520.0),
            "snapshot_after_1000_cmds_mib": _row(18.0),
            "list_1000": _row(30.0),
            "fork_16": {"p50": None, "p95": None, "p99": None, "n": 0, "missing": True},
            "idle_sandbox_rss_mib": _row(70.0),
            "some_future_row": _row(3.0),
        },
        "baseline": {
            "create_to_first_exec": _row(330.0),
            "snapshot": _row(90.0),
            "snapshot_after_1000_cmds": _row(500.0),
            "snapshot_after_1000_cmds_mib": _row(17.0),
        },
        "config": {"mode": "quick"},
        "finished_at": "2026-12-01T22:21:29+00:00",
    }


def test_bars_carry_targets_and_order() -> None:
    bars = {b.name: b for b in chart.bars(_doc())}
    names = [b.name for b in chart.bars(_doc())]
    assert names[0] == "create_to_first_exec" and names[-1] == "some_future_row"
    # An absolute target is its limit; a ratio target is ratio × the baseline's p50; a
    # relative one the other row's p50 plus its margin.
    assert bars["create_to_first_exec"].target == 38.0  # exec_roundtrip 8 + 30
    assert bars["create_to_first_exec"].met is False
    assert bars["exec_roundtrip"].met is None  # spawn_in_sandbox not measured
    assert bars["snapshot"].target == pytest.approx(135.0)
    assert bars["snapshot_after_1000_cmds"].target == pytest.approx(600.0)
    assert bars["snapshot_after_1000_cmds"].met is True
    assert bars["snapshot_after_1000_cmds_mib"].unit == "MiB"
    assert bars["list_1000"].target == 50 and bars["list_1000"].met is True
    assert bars["fork_16"].ours is None and bars["fork_16"].note == "not measured"
    assert bars["some_future_row"].target is None and bars["some_future_row"].met is None


def test_scale_series() -> None:
    s = chart.scale_series(_doc())
    assert s["create p50"] == [(1, 130.0), (10, 900.0), (50, 4000.0)]
    assert s["create p95"] == [(1, 180.0), (10, 1500.0), (50, 9000.0)]
    assert s["exec p50"] == [(1, 8.0), (10, 40.0), (50, 200.0)]
    assert s["exec p95"] == [(1, 12.0), (10, 90.0), (50, 400.0)]
    doc = _doc()
    del doc["results"]["exec_concurrent_50"]
    assert chart.scale_series(doc)["exec p50"] == [(1, 8.0), (10, 40.0)]


def test_title_names_machine_and_date() -> None:
    doc = _doc()
    assert chart.title(doc) == "aenv bench — quick run, 2026-12-01 22:21 UTC"
    sub = chart.subtitle(doc)
    assert "Test CPU" in sub and "2 cores" in sub and "0.0~20240729.0" in sub


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 20_000  # a real drawing, not an empty canvas
    # IHDR: width and height (big-endian) right after the magic and the chunk header.
    width = int.from_bytes(data[16:20], "big")
    height = int.from_bytes(data[20:24], "big")
    assert width > 1000 and height > 500


def test_render_writes_a_png(tmp_path: Path) -> None:
    out = chart.render(_doc(), tmp_path / "sub" / "latest.png")
    _assert_png(out)


def test_render_an_empty_document(tmp_path: Path) -> None:
    out = chart.render({"results": {}}, tmp_path / "empty.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_main_rerenders_from_a_results_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "run.json"
    src.write_text(json.dumps(_doc()))
    assert chart.main(["chart", str(src)]) == 0  # default: next to the JSON
    _assert_png(tmp_path / "run.png")
    assert chart.main(["chart", str(src), str(tmp_path / "other.png")]) == 0
    _assert_png(tmp_path / "other.png")
    assert chart.main(["chart", str(tmp_path / "nope.json")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_harness_writes_the_chart_next_to_latest(tmp_path: Path) -> None:
    msg = harness.write_chart(_doc(), tmp_path / "latest.png")
    assert str(tmp_path / "latest.png") in msg
    _assert_png(tmp_path / "latest.png")
