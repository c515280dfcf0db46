"""Render a bench result file as a chart (PNG): every row against its baseline, and the
scale curve of create → first exec and exec at 1, 10 and 50 concurrent sandboxes.

    .venv/bin/python -m bench.chart [bench/results/latest.json] [out.png]

Rendering only: it reads the result document (`harness.py` measures and writes it, then
calls `render`), so an old result file can be drawn again. matplotlib's Agg backend (no
display, no pyplot state)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from .report import ROW_BY_NAME, ROWS, Row, fmt_value

RESULTS = Path(__file__).resolve().parent / "results" / "latest.json"

# The scale curve: (concurrency, create row, exec row).
SCALE: tuple[tuple[int, str, str], ...] = (
    (1, "create_to_first_exec", "exec_roundtrip"),
    (10, "concurrent_create_10", "exec_concurrent_10"),
    (50, "concurrent_create_50", "exec_concurrent_50"),
)

OURS_MET = "#2e7d32"
OURS_MISSED = "#c62828"
OURS_PLAIN = "#1f77b4"
BASE = "#9e9e9e"
CREATE = "#1f77b4"
EXEC = "#ff7f0e"


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return None
    return float(value)


@dataclass(frozen=True)
class Bar:
    """One row of the bar panels: our p50, the baseline's, the target's value (an absolute
    limit, or ratio × the baseline's stat) and whether it is met (None: no target/undecided)."""

    name: str
    unit: str
    ours: float | None
    base: float | None
    target: float | None
    met: bool | None
    note: str = ""


def bars(doc: dict[str, Any]) -> list[Bar]:
    """The bar rows of a result document, in the report's order (unknown rows after)."""
    results: dict[str, Any] = doc.get("results") or {}
    baseline: dict[str, Any] = doc.get("baseline") or {}
    names = [r.name for r in ROWS if r.name in results] + sorted(set(results) - set(ROW_BY_NAME))
    out: list[Bar] = []
    for name in names:
        row = ROW_BY_NAME.get(name, Row(name, name))
        ours = results.get(name) if isinstance(results.get(name), dict) else None
        base = baseline.get(name) if isinstance(baseline.get(name), dict) else None
        target: float | None = None
        met: bool | None = None
        if row.target is not None:
            met = row.target.check(ours, base, results)
            target = row.target.bound(base, results)
        out.append(
            Bar(
                name=name,
                unit=row.unit,
                ours=_num((ours or {}).get("p50")),
                base=_num((base or {}).get("p50")),
                target=target,
                met=met,
                note="" if ours and ours.get("n") else "not measured",
            )
        )
    return out


def scale_series(doc: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """`{"create p50": [(1, ms), (10, ms), (50, ms)], "create p95": ..., "exec p50": ...,
    "exec p95": ...}`; a point without a number is left out."""
    results: dict[str, Any] = doc.get("results") or {}
    out: dict[str, list[tuple[int, float]]] = {}
    for kind, idx in (("create", 1), ("exec", 2)):
        for stat in ("p50", "p95"):
            points: list[tuple[int, float]] = []
            for entry in SCALE:
                n, row = int(entry[0]), str(entry[idx])
                value = _num((results.get(row) or {}).get(stat))
                if value is not None and value > 0:
                    points.append((n, value))
            out[f"{kind} {stat}"] = points
    return out


def _when(doc: dict[str, Any]) -> str:
    raw = doc.get("finished_at") or doc.get("started_at")
    if not isinstance(raw, str):
        return "date unknown"
    try:
        return datetime.fromisoformat(raw).strftime("%Y-%m-%d %H:%M UTC")
    except ValueError:
        return raw


def subtitle(doc: dict[str, Any]) -> str:
    m = doc.get("machine") or {}
    runtime = f"{m.get('runtime', '?')} {m.get('runtime_version', '')}".strip()
    return (
        f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('memory_gb', '?')} GB RAM, "
        f"kernel {m.get('kernel', '?')}, {runtime}"
    )


def title(doc: dict[str, Any]) -> str:
    mode = (doc.get("config") or {}).get("mode") or "?"
    return f"aenv bench — {mode} run, {_when(doc)}"


def _bar_panel(ax: Any, rows: list[Bar], unit: str, *, log: bool) -> None:
    ys = list(range(len(rows)))
    values = [v for b in rows for v in (b.ours, b.base, b.target) if v is not None and v > 0]
    lo = min(values) if values else 1.0
    hi = max(values) if values else 10.0
    left = lo / 2 if log else 0.0
    right = hi * (4 if log else 1.25)
    for y, b in zip(ys, rows, strict=True):
        color = {True: OURS_MET, False: OURS_MISSED, None: OURS_PLAIN}[b.met]
        if b.ours is not None and b.ours > 0:
            ax.barh(y - 0.2, b.ours - left, left=left, height=0.4, color=color)
            # Right of the bar, or of the target's tick when that is just right of the bar.
            end = b.ours
            if b.target is not None and b.target > b.ours:
                close = b.target < b.ours * 1.8 if log else b.target - b.ours < hi * 0.1
                end = b.target if close else b.ours
            ax.text(
                end * (1.1 if log else 1.0) + (0 if log else hi * 0.012),
                y - 0.2,
                fmt_value(b.ours, b.unit),
                va="center",
                fontsize=7,
            )
        else:
            ax.text(
                left * (1.1 if log else 1) + (0 if log else hi * 0.01),
                y,
                b.note or "–",
                va="center",
                fontsize=7,
                color="#666666",
                style="italic",
            )
        if b.base is not None and b.base > 0:
            ax.barh(y + 0.2, b.base - left, left=left, height=0.4, color=BASE)
        if b.target is not None and b.target > 0:
            ax.plot([b.target, b.target], [y - 0.45, y + 0.45], color="black", lw=1.6)
    ax.set_yticks(ys)
    ax.set_yticklabels([b.name for b in rows], fontsize=8, family="monospace")
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    ax.set_xlim(left, right)
    ax.set_xlabel(f"p50 ({unit}{', log scale' if log else ''})", fontsize=9)
    ax.grid(axis="x", which="major", alpha=0.3)
    ax.tick_params(axis="x", labelsize=8)


def _scale_panel(ax: Any, doc: dict[str, Any]) -> None:
    series = scale_series(doc)
    styles = {
        "create p50": (CREATE, "-", "o"),
        "create p95": (CREATE, "--", "s"),
        "exec p50": (EXEC, "-", "o"),
        "exec p95": (EXEC, "--", "s"),
    }
    labels = {
        "create p50": "create → first exec, p50",
        "create p95": "create → first exec, p95",
        "exec p50": "exec round-trip, p50",
        "exec p95": "exec round-trip, p95",
    }
    drawn = False
    for key, points in series.items():
        if not points:
            continue
        drawn = True
        color, ls, marker = styles[key]
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            ls=ls,
            marker=marker,
            color=color,
            label=labels[key],
        )
        # create labels right of the points, exec labels left; p95 above, p50 below.
        dx = 6 if key.startswith("create") else -6
        dy = 4 if key.endswith("p95") else -10
        for x, y in points:
            ax.annotate(
                fmt_value(y),
                (x, y),
                textcoords="offset points",
                xytext=(dx, dy),
                fontsize=7,
                color=color,
                ha="left" if dx > 0 else "right",
            )
    # The targets on the curve: create p50 at 1, exec p50 at 1, create p95 at 50.
    results = doc.get("results") or {}
    marks = [
        (1, "create_to_first_exec", CREATE),
        (1, "exec_roundtrip", EXEC),
        (50, "concurrent_create_50", CREATE),
    ]
    first = True
    for x, name, color in marks:
        row = ROW_BY_NAME.get(name)
        if row is None or row.target is None or name not in results:
            continue
        limit = row.target.bound((doc.get("baseline") or {}).get(name), results)
        if limit is None:
            continue
        ax.plot(
            [x],
            [limit],
            marker="_",
            markersize=22,
            mew=2.5,
            color=color,
            label="target" if first else None,
            ls="none",
        )
        ax.annotate(
            f"target {row.target.describe(row.unit)}",
            (x, limit),
            textcoords="offset points",
            xytext=(12, -3) if x == 1 else (-12, -3),
            fontsize=7,
            color=color,
            ha="left" if x == 1 else "right",
        )
        first = False
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks([1, 10, 50])
    ax.set_xticklabels(["1", "10", "50"])
    ax.set_xlim(0.5, 90)
    ax.set_xlabel("sandboxes at once", fontsize=9)
    ax.set_ylabel("ms per sandbox (log scale)", fontsize=9)
    ax.set_title("scale: latency per sandbox vs concurrency", fontsize=10)
    ax.grid(which="major", alpha=0.3)
    ax.tick_params(labelsize=8)
    if drawn:
        ax.legend(fontsize=7, loc="upper left")
    else:
        ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", color="#666666")


def render(doc: dict[str, Any], out: Path) -> Path:
    """Draws the chart of a result document into `out` (PNG) and returns the path."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    all_bars = bars(doc)
    ms_rows = [b for b in all_bars if b.unit == "ms"]
    other = [b for b in all_bars if b.unit != "ms"]
    n_ms, n_other = max(1, len(ms_rows)), len(other)
    height = max(8.0, 1.6 + 0.3 * (n_ms + n_other) + (0.9 if n_other else 0))
    fig = Figure(figsize=(17, height), dpi=110)
    fig.suptitle(title(doc), fontsize=14, fontweight="bold", y=0.995)
    fig.text(0.5, 1 - 0.42 / height, subtitle(doc), ha="center", fontsize=9, color="#444444")
    grid = fig.add_gridspec(
        2 if n_other else 1,
        2,
        width_ratios=[1.45, 1],
        height_ratios=[n_ms, max(2, n_other) + 0.8] if n_other else None,
        left=0.2,
        right=0.98,
        top=1 - 1.15 / height,
        bottom=0.7 / height,
        hspace=0.25,
        wspace=0.16,
    )
    ax_ms = fig.add_subplot(grid[0, 0])
    _bar_panel(ax_ms, ms_rows, "ms", log=True)
    ax_ms.set_title("each row against its baseline (p50)", fontsize=10)
    if n_other:
        ax_mib = fig.add_subplot(grid[1, 0])
        units = sorted({b.unit for b in other})
        # Rows of several units (MiB, mc, s...) share the axis: each is labelled with its own,
        # on a log scale so that 0.5 mc and 100 MiB both show.
        mixed = len(units) > 1
        _bar_panel(ax_mib, other, "each row's unit" if mixed else units[0], log=mixed)
    ax_scale = fig.add_subplot(grid[:, 1] if n_other else grid[0, 1])
    _scale_panel(ax_scale, doc)
    handles = [
        Patch(color=OURS_MET, label="ours p50, target met"),
        Patch(color=OURS_MISSED, label="ours p50, target missed"),
        Patch(color=OURS_PLAIN, label="ours p50 (no target)"),
        Patch(color=BASE, label="baseline p50: raw runsc, or the row's reference (see note)"),
        Patch(color="black", label="target (absolute, or ratio × baseline)"),
    ]
    fig.legend(
        handles=handles,
        fontsize=8,
        loc="upper center",
        ncol=len(handles),
        frameon=False,
        bbox_to_anchor=(0.5, 1 - 0.62 / height),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def main(argv: list[str]) -> int:
    src = Path(argv[1]) if len(argv) > 1 else RESULTS
    dst = Path(argv[2]) if len(argv) > 2 else src.with_suffix(".png")
    try:
        doc = json.loads(src.read_text())
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"chart: cannot read {src}: {exc}\n")
        return 1
    try:
        render(doc, dst)
    except ImportError as exc:
        sys.stderr.write(f"chart: matplotlib is needed ({exc}); pip install matplotlib\n")
        return 1
    sys.stdout.write(f"{dst}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
