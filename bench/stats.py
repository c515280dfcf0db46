"""Pure helpers: percentiles, summaries, `Server-Timing` parsing, and the result document."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .report import REQUIRED


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default): rank = p/100 · (n-1)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} outside 0..100")
    xs = sorted(float(v) for v in values)
    rank = p / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = math.ceil(rank)
    if lo == hi:
        return xs[lo]
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarize(values: Sequence[float], digits: int = 2) -> dict[str, Any]:
    """`{"p50", "p95", "p99", "n"}` of the samples (None percentiles when there are none)."""
    if not values:
        return {"p50": None, "p95": None, "p99": None, "n": 0}
    return {
        "p50": round(percentile(values, 50), digits),
        "p95": round(percentile(values, 95), digits),
        "p99": round(percentile(values, 99), digits),
        "n": len(values),
    }


_TOKEN = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")


def parse_server_timing(value: str | None) -> dict[str, float]:
    """`Server-Timing: boot;dur=12.5, envd;desc="x";dur=3` → {"boot": 12.5, "envd": 3.0}.
    Metrics without a `dur` are left out; a repeated name adds up."""
    out: dict[str, float] = {}
    if not value:
        return out
    for metric in value.split(","):
        parts = [p.strip() for p in metric.split(";")]
        name = parts[0]
        if not name or not _TOKEN.match(name):
            continue
        for param in parts[1:]:
            key, _, raw = param.partition("=")
            if key.strip().lower() != "dur":
                continue
            try:
                dur = float(raw.strip().strip('"'))
            except ValueError:
                break
            if math.isfinite(dur):
                out[name] = out.get(name, 0.0) + dur
            break
    return out


@dataclass
class Series:
    """The samples of one row on one side (ours or baseline)."""

    samples: list[float] = field(default_factory=list)
    stages: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    missing: str | None = None

    def add(self, value: float, stages: Mapping[str, float] | None = None) -> None:
        self.samples.append(float(value))
        for name, ms in (stages or {}).items():
            self.stages.setdefault(name, []).append(float(ms))

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def summary(self) -> dict[str, Any]:
        out = summarize(self.samples)
        text = "; ".join(([self.missing] if self.missing else []) + self.notes)
        if self.missing and not self.samples:
            out["missing"] = True
        if text:
            out["note"] = text
        return out

    def stage_p50(self) -> dict[str, float]:
        return {k: round(statistics.median(v), 2) for k, v in self.stages.items() if v}


class Results:
    """Everything one run measured: per row, our series and the baseline's."""

    def __init__(self) -> None:
        self.ours: dict[str, Series] = {}
        self.base: dict[str, Series] = {}

    def series(self, name: str, *, baseline: bool = False) -> Series:
        table = self.base if baseline else self.ours
        return table.setdefault(name, Series())

    def add(
        self,
        name: str,
        value: float,
        stages: Mapping[str, float] | None = None,
        *,
        baseline: bool = False,
    ) -> None:
        self.series(name, baseline=baseline).add(value, stages)

    def missing(self, names: Iterable[str], note: str, *, baseline: bool = False) -> None:
        """Marks rows as not measured (an endpoint the server lacks, a failed step)."""
        for name in names:
            s = self.series(name, baseline=baseline)
            if s.missing is None:
                s.missing = note
            else:
                s.note(note)

    def note(self, name: str, text: str, *, baseline: bool = False) -> None:
        self.series(name, baseline=baseline).note(text)

    def has_samples(self, name: str, *, baseline: bool = False) -> bool:
        table = self.base if baseline else self.ours
        return bool(table.get(name) and table[name].samples)

    def document(
        self, machine: Mapping[str, Any], extra: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The JSON document: machine, results (every required row, measured or not),
        baseline (rows it has), stages (per-row p50 of each Server-Timing stage)."""
        results: dict[str, Any] = {}
        for name in [*REQUIRED, *sorted(set(self.ours) - set(REQUIRED))]:
            s = self.ours.get(name)
            if s is None:
                s = Series(missing="not measured in this run")
            results[name] = s.summary()
        baseline = {name: s.summary() for name, s in self.base.items()}
        stages = {name: s.stage_p50() for name, s in self.ours.items() if s.stages}
        base_stages = {name: s.stage_p50() for name, s in self.base.items() if s.stages}
        doc: dict[str, Any] = {
            "machine": dict(machine),
            "results": results,
            "baseline": baseline,
            "stages": stages,
        }
        if base_stages:
            doc["baseline_stages"] = base_stages
        doc.update(extra or {})
        return doc
