"""One result document from several runs: each row from the newest run that measured it (its
baseline and stages with it), so the rows measured in separate runs (`--only`, the heavy
scenarios on their own) make one table and one chart. Which run each row came from is kept
in the row's note and in `config.combined_from`.

    .venv/bin/python -m bench.combine OUT.json RUN.json [RUN.json ...]

The chart of it: `python -m bench.chart OUT.json OUT.png`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def measured(doc: dict[str, Any], row: str) -> bool:
    return bool((doc.get("results", {}).get(row) or {}).get("n"))


def combine(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rows of `docs`, each from the newest one (`started_at`) that measured it; a row
    none measured is taken as the newest document has it (missing)."""
    if not docs:
        raise ValueError("no result documents to combine")
    newest_first = sorted(docs, key=lambda d: str(d.get("started_at", "")), reverse=True)
    out: dict[str, Any] = {
        "machine": newest_first[0].get("machine", {}),
        "results": {},
        "baseline": {},
        "stages": {},
        "config": dict(newest_first[0].get("config", {})),
        "started_at": min(str(d.get("started_at", "")) for d in docs),
        "finished_at": max(str(d.get("finished_at", "")) for d in docs),
    }
    rows: list[str] = []
    for d in newest_first:
        rows.extend(r for r in d.get("results", {}) if r not in rows)
    used: set[str] = set()
    for row in rows:
        src = next((d for d in newest_first if measured(d, row)), newest_first[0])
        result = dict(src.get("results", {}).get(row) or {})
        when = str(src.get("started_at", "?"))
        if measured(src, row):
            used.add(when)
            result["note"] = "; ".join(x for x in (result.get("note"), f"run {when}") if x)
        out["results"][row] = result
        for part in ("baseline", "stages"):
            if row in src.get(part, {}):
                out[part][row] = src[part][row]
    out["config"]["combined_from"] = sorted(used)
    out["config"]["mode"] = "combined"
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        sys.stderr.write("usage: python -m bench.combine OUT.json RUN.json [RUN.json ...]\n")
        return 2
    try:
        docs = [json.loads(Path(p).read_text()) for p in argv[2:]]
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"combine: {exc}\n")
        return 1
    Path(argv[1]).write_text(json.dumps(combine(docs), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
