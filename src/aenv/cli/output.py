"""Rendering for the CLI: rich tables for people, JSON for scripts."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

_FRACTION = re.compile(r"(\.\d{6})\d+")


def console(stderr: bool = False) -> Console:
    """A console on stdout/stderr; wide when not a terminal so IDs are never cut."""
    stream = sys.stderr if stderr else sys.stdout
    isatty = hasattr(stream, "isatty") and stream.isatty()
    return Console(file=stream, width=None if isatty else 250, soft_wrap=False)


def print_table(table: Table) -> None:
    """A table on stdout; without a terminal, plain text without trailing blanks."""
    con = console()
    if con.is_terminal:
        con.print(table)
        return
    with con.capture() as cap:
        con.print(table)
    text = "\n".join(line.rstrip() for line in cap.get().splitlines())
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def print_listing(
    items: Sequence[Any], *, as_json: bool, empty: str, table: Callable[[Any], Table]
) -> None:
    """A list command's output: JSON for scripts, else a table, or one dim line on stderr
    when there is nothing to show."""
    if as_json:
        print_json(items)
    elif not items:
        console(stderr=True).print(empty, style="dim")
    else:
        print_table(table(items))


def parse_time(value: Any) -> datetime | None:
    """An RFC 3339 timestamp (any fraction length, `Z` suffix) as an aware datetime."""
    if not isinstance(value, str) or not value:
        return None
    try:
        dt = datetime.fromisoformat(_FRACTION.sub(r"\1", value.strip()))
    except ValueError:
        return None
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


def human_duration(seconds: float) -> str:
    s = int(abs(seconds))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def local_time(value: Any) -> str:
    dt = parse_time(value)
    if dt is None:
        return str(value) if value else "-"
    return dt.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def relative_time(value: Any, now: datetime | None = None) -> str:
    """Like "in 4m12s" or "3m05s ago"."""
    dt = parse_time(value)
    if dt is None:
        return str(value) if value else "-"
    delta = (dt - (now or datetime.now(UTC))).total_seconds()
    return f"in {human_duration(delta)}" if delta >= 0 else f"{human_duration(delta)} ago"


def format_metadata(metadata: Any) -> str:
    if not isinstance(metadata, Mapping) or not metadata:
        return ""
    return ", ".join(f"{k}={v}" for k, v in metadata.items())


def format_mb(value: Any) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{int(value)} MB" if value < 10240 else f"{value / 1024:.0f} GB"
    return "-" if value is None else str(value)


def _cell(value: Any, style: str = "") -> Text:
    """Server data as plain text (never parsed as rich markup)."""
    return Text("-" if value is None or value == "" else str(value), style=style)


def id_width(rows: Sequence[Mapping[str, Any]], key: str = "sandboxID") -> int:
    """The widest ID: ID columns never shrink below it (a cut ID is no use)."""
    return max((len(str(r.get(key) or "")) for r in rows), default=2)


def sandbox_table(sandboxes: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("ID", no_wrap=True, min_width=id_width(sandboxes))
    table.add_column("TEMPLATE", no_wrap=True)
    table.add_column("STATE", no_wrap=True, min_width=7)
    table.add_column("STARTED", no_wrap=True)
    table.add_column("ENDS", no_wrap=True)
    table.add_column("CPU", justify="right", no_wrap=True)
    table.add_column("MEMORY", justify="right", no_wrap=True)
    table.add_column("METADATA", overflow="fold")
    for sb in sandboxes:
        state = str(sb.get("state", "-"))
        style = {"running": "green", "paused": "yellow"}.get(state, "")
        table.add_row(
            _cell(sb.get("sandboxID")),
            _cell(sb.get("alias") or sb.get("templateID")),
            _cell(state, style),
            _cell(local_time(sb.get("startedAt"))),
            _cell("-" if state == "paused" else relative_time(sb.get("endAt"))),
            _cell(sb.get("cpuCount")),
            _cell(format_mb(sb.get("memoryMB"))),
            _cell(format_metadata(sb.get("metadata"))),
        )
    return table


# Fields of `GET /sandboxes/{id}` shown by `aenv info`, in order (others follow).
_INFO_ORDER = (
    "sandboxID",
    "templateID",
    "alias",
    "state",
    "startedAt",
    "endAt",
    "cpuCount",
    "memoryMB",
    "diskSizeMB",
    "envdVersion",
    "metadata",
)
_INFO_HIDDEN = {"envdAccessToken", "trafficAccessToken"}


def info_table(info: Mapping[str, Any]) -> Table:
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    keys = [k for k in _INFO_ORDER if k in info]
    keys += [k for k in info if k not in _INFO_ORDER and k not in _INFO_HIDDEN]
    for key in keys:
        value = info[key]
        if key in ("startedAt", "endAt"):
            text = f"{local_time(value)} ({relative_time(value)})"
        elif key in ("memoryMB", "diskSizeMB"):
            text = format_mb(value)
        elif key == "metadata":
            text = format_metadata(value) or "-"
        elif isinstance(value, dict | list):
            text = json.dumps(value)
        else:
            text = str(value)
        table.add_row(key, _cell(text))
    return table


def template_table(templates: Iterable[Mapping[str, Any]]) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("ID", no_wrap=True)
    table.add_column("NAMES", overflow="fold")
    table.add_column("STATUS", no_wrap=True)
    table.add_column("CPU", justify="right", no_wrap=True)
    table.add_column("MEMORY", justify="right", no_wrap=True)
    table.add_column("DISK", justify="right", no_wrap=True)
    table.add_column("CREATED", no_wrap=True)
    for t in templates:
        names = t.get("names") or t.get("aliases") or []
        table.add_row(
            _cell(t.get("templateID")),
            _cell(", ".join(str(n) for n in names) if isinstance(names, list) else names),
            _cell(t.get("buildStatus")),
            _cell(t.get("cpuCount")),
            _cell(format_mb(t.get("memoryMB"))),
            _cell(format_mb(t.get("diskSizeMB"))),
            _cell(local_time(t.get("createdAt"))),
        )
    return table
