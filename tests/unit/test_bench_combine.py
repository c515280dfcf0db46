"""bench/combine.py: rows measured in separate runs make one document, each row from the
newest run that measured it, with its baseline and the run named."""

from __future__ import annotations

from typing import Any

import pytest

from bench.combine import combine


def run(when: str, **rows: float | None) -> dict[str, Any]:
    results = {
        name: {"p50": v, "n": 0 if v is None else 3} | ({"missing": True} if v is None else {})
        for name, v in rows.items()
    }
    baseline = {name: {"p50": v * 2, "n": 3} for name, v in rows.items() if v is not None}
    return {"started_at": when, "finished_at": when, "results": results, "baseline": baseline}


def test_each_row_comes_from_the_newest_run_that_measured_it() -> None:
    old = run("2026-12-01T00:00:00", create=10.0, fork=20.0, idle=None)
    new = run("2026-12-02T00:00:00", create=12.0, fork=None, idle=None)
    doc = combine([new, old])
    assert doc["results"]["create"]["p50"] == 12.0
    assert doc["results"]["fork"]["p50"] == 20.0
    assert doc["baseline"]["fork"]["p50"] == 40.0
    assert doc["results"]["fork"]["note"].endswith("run 2026-12-01T00:00:00")
    assert doc["results"]["idle"]["missing"] is True
    assert doc["config"]["combined_from"] == ["2026-12-01T00:00:00", "2026-12-02T00:00:00"]


def test_nothing_to_combine_is_an_error() -> None:
    with pytest.raises(ValueError):
        combine([])
