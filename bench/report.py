"""Render a bench result file (`bench/results/latest.json`) as a Markdown table.

    .venv/bin/python bench/report.py [bench/results/latest.json] > table.md

Standard library only, so it runs as a plain script; `aenv bench` imports the row list, the
targets and the formatting from here, so the terminal table and the Markdown agree.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Target:
    """`stat` of our result must be at most each bound given: `limit` (absolute, in the
    row's unit), `ratio` times the same stat of the baseline, and `times` the same stat of
    our row `row` plus `plus` (a target relative to another measurement of the same run)."""

    stat: str = "p50"
    limit: float | None = None
    ratio: float | None = None
    row: str | None = None
    plus: float = 0.0
    times: float = 1.0

    def describe(self, unit: str) -> str:
        parts = []
        if self.ratio is not None:
            parts.append(f"{self.ratio:g}× baseline")
        if self.row is not None:
            rel = f"{self.times:g}× {self.row}" if self.times != 1.0 else self.row
            parts.append(f"{rel} + {self.plus:g} {unit}" if self.plus else rel)
        if self.limit is not None:
            if unit == "ms" and self.limit >= 1000:
                parts.append(f"{self.limit / 1000:g} s")
            else:
                parts.append(f"{self.limit:g} {unit}")
        return f"{self.stat} ≤ " + " and ≤ ".join(parts) if parts else ""

    def bounds(
        self, base: dict[str, Any] | None, results: dict[str, Any] | None = None
    ) -> list[float] | None:
        """The numbers our stat must not exceed; None when one cannot be known."""
        out: list[float] = []
        if self.ratio is not None:
            ref = _num((base or {}).get(self.stat))
            if ref is None or ref <= 0:
                return None
            out.append(self.ratio * ref)
        if self.row is not None:
            other = (results or {}).get(self.row)
            ref = _num(other.get(self.stat)) if isinstance(other, dict) else None
            if ref is None:
                return None
            out.append(self.times * ref + self.plus)
        if self.limit is not None:
            out.append(self.limit)
        return out or None

    def bound(
        self, base: dict[str, Any] | None, results: dict[str, Any] | None = None
    ) -> float | None:
        """The tightest of `bounds` (what a chart marks)."""
        found = self.bounds(base, results)
        return min(found) if found else None

    def check(
        self,
        ours: dict[str, Any] | None,
        base: dict[str, Any] | None,
        results: dict[str, Any] | None = None,
    ) -> bool | None:
        """True/False when it can be decided, None when a number is missing. `results`: all
        of ours, for a target relative to another row."""
        value = _num((ours or {}).get(self.stat))
        limit = self.bound(base, results)
        if value is None or limit is None:
            return None
        return value <= limit


@dataclass(frozen=True)
class Row:
    name: str
    title: str
    unit: str = "ms"
    target: Target | None = None


# Every row the harness measures, in display order. The targets are issue 14's and, for the
# idle CPU rows (mc: thousandths of a core), issue 21's.
ROWS: tuple[Row, ...] = (
    Row(
        "create_to_first_exec",
        "create → first exec (warm pool)",
        target=Target("p50", row="exec_roundtrip", plus=30),
    ),
    Row(
        "create_to_first_exec_cold",
        "create → first exec (no pool)",
        target=Target("p50", ratio=1.0),
    ),
    Row(
        "exec_roundtrip",
        "exec `true` round-trip",
        target=Target("p50", row="spawn_in_sandbox", plus=10),
    ),
    Row("spawn_in_sandbox", "`bash -l -c true` spawned inside the sandbox (exec's floor)"),
    Row("file_write_1mib", "write 1 MiB file"),
    Row("file_read_1mib", "read 1 MiB file"),
    Row("pause", "pause (freeze)", target=Target("p50", 20)),
    Row("resume", "resume (thaw)", target=Target("p50", 20)),
    Row("hibernate", "pause → hibernated", target=Target("p50", ratio=1.2)),
    Row("resume_from_disk", "resume from disk", target=Target("p50", ratio=1.2)),
    Row("snapshot", "snapshot (running)", target=Target("p50", ratio=1.5)),
    Row("snapshot_dirty_1gib", "snapshot after 1 GiB written", target=Target("p50", ratio=1.5)),
    Row(
        "diff_10_of_1gib",
        "diff of a fork child that changed 10 of 1,024 MiB files (vs its snapshot)",
        target=Target("p50", ratio=1.5),
    ),
    Row(
        "apply_10_of_1gib",
        "apply those 10 changed files to the parent (vs the child's snapshot)",
        target=Target("p50", ratio=1.5),
    ),
    Row(
        "rollback",
        "rollback in place to a memory snapshot",
        target=Target("p50", row="resume_from_disk", times=1.2),
    ),
    Row(
        "snapshot_after_1000_cmds",
        "snapshot after 1,000 commands (vs a fresh sandbox's)",
        target=Target("p50", ratio=1.2),
    ),
    Row(
        "snapshot_after_1000_cmds_mib",
        "its memory image (vs a fresh sandbox's)",
        unit="MiB",
        target=Target("p50", ratio=1.2),
    ),
    Row("fork_1", "fork ×1 → child answers"),
    Row("fork_4", "fork ×4 → all answer"),
    Row("fork_16", "fork ×16 → all answer", target=Target("p50", 3000, ratio=1.0)),
    Row("concurrent_create_10", "create+exec, 10 at once (each)"),
    Row("concurrent_create_50", "create+exec, 50 at once (each)", target=Target("p95", 6000)),
    Row("exec_concurrent_10", "exec, 10 sandboxes at once (each)"),
    Row("exec_concurrent_50", "exec, 50 sandboxes at once (each)"),
    Row(
        "create_to_first_exec_with_100",
        "create → first exec, ~100 sandboxes on the node (vs one)",
        target=Target("p50", ratio=1.2),
    ),
    Row(
        "exec_roundtrip_with_100",
        "exec round-trip, ~100 sandboxes on the node (vs one)",
        target=Target("p50", ratio=1.2),
    ),
    Row("list_1000", "list sandboxes, 1,000 on the node", target=Target("p50", 50)),
    *(
        row
        for n in (1, 8, 32)
        for row in (
            Row(
                f"rollout_cpu_s_{n}",
                f"rollout episode, {n} at once: CPU-seconds each",
                unit="s",
                target=Target("p50", ratio=1.3),
            ),
            Row(f"rollout_rate_{n}", f"rollout episodes, {n} at once", unit="/min/core"),
            Row(
                f"rollout_health_p99_{n}",
                f"/health p99 under {n} rollouts at once",
                target=Target("p50", 50),
            ),
        )
    ),
    Row(
        "idle_node_mc",
        "machine busy CPU, node with no sandboxes",
        unit="mc",
        target=Target("p50", 20),
    ),
    Row(
        "idle_sandbox_mc",
        "busy CPU per idle sandbox (~100 on the node)",
        unit="mc",
        target=Target("p50", 1),
    ),
    Row("qemu_create_to_first_exec", "QEMU microVM (TCG-emulated here): create → first exec"),
    Row("qemu_exec_roundtrip", "QEMU microVM (TCG): exec `true` round-trip"),
    Row("qemu_pause", "QEMU microVM (TCG): pause (vCPUs stopped)"),
    Row("qemu_resume", "QEMU microVM (TCG): resume"),
    Row("qemu_snapshot", "QEMU microVM (TCG): snapshot (running)"),
    Row("qemu_fork_1", "QEMU microVM (TCG): fork ×1 → child answers"),
    Row("qemu_idle_sandbox_mc", "QEMU microVM (TCG): node CPU per idle VM", unit="mc"),
    Row("thousand_create", "create, the 101st to 1,000th on the node (each)"),
    Row("thousand_list", "list sandboxes, 1,000 present (standby ones included)"),
    Row("thousand_exec", "a command each, 1,000 present (most restored from disk)"),
    Row("thousand_kill", "kill each of 1,000"),
    Row("thousand_node_rss_mib", "server RSS, 1,000 sandboxes on the node", unit="MiB"),
    Row("thousand_mem_per_sandbox_mib", "machine memory per sandbox of 1,000", unit="MiB"),
    Row("idle_sandbox_rss_mib", "idle sandbox host RSS", unit="MiB"),
    Row(
        "idle_sandbox_pss_mib",
        "idle sandbox host PSS (+stubs)",
        unit="MiB",
        target=Target("p50", 30),
    ),
)
ROW_BY_NAME = {r.name: r for r in ROWS}
REQUIRED = tuple(r.name for r in ROWS)

HEADERS = ("row", "ours p50", "ours p95", "n", "baseline p50", "ours/baseline", "target", "met")


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def fmt_value(value: Any, unit: str = "ms") -> str:
    v = _num(value)
    if v is None:
        return "–"
    if unit == "ms" and v >= 10_000:
        return f"{v / 1000:.1f} s"
    if v >= 100:
        return f"{v:.0f} {unit}"
    return f"{v:.1f} {unit}"


def ratio(
    ours: dict[str, Any] | None, base: dict[str, Any] | None, stat: str = "p50"
) -> float | None:
    a = _num((ours or {}).get(stat))
    b = _num((base or {}).get(stat))
    if a is None or b is None or b <= 0:
        return None
    return a / b


def table_rows(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    """One tuple of cells (plain text) per row: the HEADERS columns, then a note."""
    results: dict[str, Any] = doc.get("results") or {}
    baseline: dict[str, Any] = doc.get("baseline") or {}
    names = [r.name for r in ROWS] + sorted(set(results) - set(ROW_BY_NAME))
    out: list[tuple[str, ...]] = []
    for name in names:
        row = ROW_BY_NAME.get(name, Row(name, name))
        ours = results.get(name)
        base = baseline.get(name)
        r = ratio(ours, base)
        met = row.target.check(ours, base, results) if row.target else None
        note = ""
        if isinstance(ours, dict) and ours.get("note"):
            note = str(ours["note"])
        elif isinstance(base, dict) and base.get("note") and not ours:
            note = f"baseline: {base['note']}"
        out.append(
            (
                name,
                fmt_value((ours or {}).get("p50"), row.unit),
                fmt_value((ours or {}).get("p95"), row.unit),
                str((ours or {}).get("n") or 0),
                fmt_value((base or {}).get("p50"), row.unit),
                f"{r:.2f}×" if r is not None else "–",
                row.target.describe(row.unit) if row.target else "",
                {True: "✔", False: "✘", None: ""}[met],
                note,
            )
        )
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(doc: dict[str, Any]) -> str:
    """The Markdown table (plus a line about the machine and a list of notes)."""
    m = doc.get("machine") or {}
    lines = []
    when = doc.get("finished_at") or doc.get("started_at") or ""
    mode = (doc.get("config") or {}).get("mode", "")
    lines.append(
        f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
        f"{m.get('memory_gb', '?')} GB, kernel {m.get('kernel', '?')}, "
        f"{m.get('runtime', '?')} {m.get('runtime_version', '')}".rstrip()
        + (f"; {mode} run" if mode else "")
        + (f", {when}" if when else "")
        + "."
    )
    lines.append("")
    lines.append("| " + " | ".join(HEADERS) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * 5 + ["---", ":-:"]) + "|")
    notes = []
    for cells in table_rows(doc):
        *main, note = cells
        if note:
            notes.append(f"- `{main[0]}`: {note}")
        lines.append("| " + " | ".join(_cell(c) for c in main) + " |")
    if notes:
        lines.append("")
        lines.extend(_cell(n) for n in notes)
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    path = (
        Path(argv[1])
        if len(argv) > 1
        else Path(__file__).resolve().parent / "results" / "latest.json"
    )
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"report: cannot read {path}: {exc}\n")
        return 1
    sys.stdout.write(render_markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
