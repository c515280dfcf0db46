"""Rendering for the CLI, in one place: rich tables for people, JSON and YAML for scripts,
bare IDs for pipes (`-q`), for every listing and every one-object view (`inspect`,
`status`). A listing is described once (`Listing`: its columns, which are `-o wide` only,
and what its ID is); the formats are never re-implemented per command."""

from __future__ import annotations

import enum
import json
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from rich.console import Console
from rich.table import Table
from rich.text import Text

_FRACTION = re.compile(r"(\.\d{6})\d+")


class OutputFormat(enum.StrEnum):
    """`-o`: `wide` is the table with more columns (kubectl's), json and yaml the data as
    the server gave it."""

    table = "table"
    wide = "wide"
    json = "json"
    yaml = "yaml"


def console(stderr: bool = False) -> Console:
    """A console on stdout/stderr; wide when not a terminal so IDs are never cut."""
    stream = sys.stderr if stderr else sys.stdout
    isatty = hasattr(stream, "isatty") and stream.isatty()
    return Console(file=stream, width=None if isatty else 250, soft_wrap=False)


def table_text(table: Table) -> str:
    """A table as text: styled on a terminal, else plain without trailing blanks."""
    con = console()
    with con.capture() as cap:
        con.print(table)
    text = cap.get()
    if con.is_terminal:
        return text
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def print_table(table: Table) -> None:
    """A table on stdout; without a terminal, plain text without trailing blanks."""
    con = console()
    if con.is_terminal:
        con.print(table)
        return
    sys.stdout.write(table_text(table))
    sys.stdout.flush()


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def dump(data: Any, fmt: OutputFormat) -> str:
    """`data` as a JSON or YAML document (keys in the server's order)."""
    if fmt is OutputFormat.yaml:
        import yaml

        return str(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    return json.dumps(data, indent=2, sort_keys=False) + "\n"


@dataclass(frozen=True)
class Column:
    """One column of a listing: its header, its cell from an item, and whether only `-o
    wide` shows it. `key`: an ID column never shrinks below its widest value (a cut ID is
    no use)."""

    header: str
    cell: Callable[[Mapping[str, Any]], Any]
    wide: bool = False
    justify: Literal["left", "right"] = "left"
    fold: bool = False  # long text folds onto more lines instead of being cut
    style: Callable[[Mapping[str, Any]], str] | None = None
    key: bool = False


@dataclass(frozen=True)
class Listing:
    """What a listing command shows: its columns, what `-q` prints (the ID), and the dim
    line on stderr when there is nothing."""

    columns: tuple[Column, ...]
    id_of: Callable[[Mapping[str, Any]], Any]
    empty: str
    boxed: bool = False  # the few tables that had borders keep them

    def table(self, items: Sequence[Mapping[str, Any]], *, wide: bool = False) -> Table:
        table = (
            Table(header_style="bold")
            if self.boxed
            else Table(box=None, header_style="bold", pad_edge=False)
        )
        columns = [c for c in self.columns if wide or not c.wide]
        for c in columns:
            width = max((len(_plain(c.cell(i))) for i in items), default=2) if c.key else None
            table.add_column(
                c.header,
                justify=c.justify,
                no_wrap=not c.fold,
                overflow="fold" if c.fold else "ellipsis",
                min_width=width,
            )
        for item in items:
            table.add_row(*(_cell(c.cell(item), c.style(item) if c.style else "") for c in columns))
        return table


def _plain(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def resolve_format(
    output: OutputFormat | None, *, json_flag: bool = False, piped: OutputFormat | None = None
) -> OutputFormat:
    """The format asked for: `-o`, else the deprecated `--json`, else a table, or `piped`
    when stdout is not a terminal (the few listings that always did so: `ls`, `tags ls`)."""
    if output is not None:
        return output
    if json_flag:
        return OutputFormat.json
    if piped is not None and not _stdout_is_tty():
        return piped
    return OutputFormat.table


def _stdout_is_tty() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def render_listing(
    items: Sequence[Mapping[str, Any]], listing: Listing, fmt: OutputFormat, quiet: bool = False
) -> str:
    """A listing as the text stdout gets (`""` for an empty table: the note goes to
    stderr instead)."""
    if quiet:
        return "".join(f"{listing.id_of(i)}\n" for i in items)
    if fmt in (OutputFormat.json, OutputFormat.yaml):
        return dump(list(items), fmt)
    if not items:
        return ""
    return table_text(listing.table(items, wide=fmt is OutputFormat.wide))


def print_listing(
    items: Sequence[Mapping[str, Any]],
    listing: Listing,
    fmt: OutputFormat,
    quiet: bool = False,
) -> None:
    """A list command's output: IDs (`-q`), JSON or YAML for scripts, else a table, or one
    dim line on stderr when a table would be empty."""
    if not items and not quiet and fmt in (OutputFormat.table, OutputFormat.wide):
        console(stderr=True).print(listing.empty, style="dim")
        return
    sys.stdout.write(render_listing(items, listing, fmt, quiet))
    sys.stdout.flush()


def print_document(data: Any, fmt: OutputFormat, table: Callable[[Any], Table]) -> None:
    """One object (`inspect`, `status`): a two-column table, or JSON or YAML."""
    if fmt in (OutputFormat.json, OutputFormat.yaml):
        sys.stdout.write(dump(data, fmt))
        sys.stdout.flush()
    else:
        print_table(table(data))


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


def _state_style(sb: Mapping[str, Any]) -> str:
    return {"running": "green", "paused": "yellow"}.get(str(sb.get("state")), "")


SANDBOXES = Listing(
    columns=(
        Column("ID", lambda sb: sb.get("sandboxID"), key=True),
        Column("TEMPLATE", lambda sb: sb.get("alias") or sb.get("templateID")),
        Column("TEMPLATE ID", lambda sb: sb.get("templateID"), wide=True),
        Column("STATE", lambda sb: sb.get("state", "-"), style=_state_style),
        Column("STARTED", lambda sb: local_time(sb.get("startedAt"))),
        Column(
            "ENDS",
            lambda sb: "-" if sb.get("state") == "paused" else relative_time(sb.get("endAt")),
        ),
        Column("CPU", lambda sb: sb.get("cpuCount"), justify="right"),
        Column("MEMORY", lambda sb: format_mb(sb.get("memoryMB")), justify="right"),
        Column("DISK", lambda sb: format_mb(sb.get("diskSizeMB")), wide=True, justify="right"),
        Column("ENVD", lambda sb: sb.get("envdVersion"), wide=True),
        Column("METADATA", lambda sb: format_metadata(sb.get("metadata")), fold=True),
    ),
    id_of=lambda sb: sb.get("sandboxID"),
    empty="no sandboxes",
)


def sandbox_table(sandboxes: Sequence[Mapping[str, Any]]) -> Table:
    return SANDBOXES.table(sandboxes)


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


def _names(t: Mapping[str, Any]) -> str:
    names = t.get("names") or t.get("aliases") or []
    return ", ".join(str(n) for n in names) if isinstance(names, list) else str(names)


TEMPLATES = Listing(
    columns=(
        Column("ID", lambda t: t.get("templateID"), key=True),
        Column("NAMES", _names, fold=True),
        Column("STATUS", lambda t: t.get("buildStatus")),
        Column("BUILD", lambda t: t.get("buildID"), wide=True),
        Column("CPU", lambda t: t.get("cpuCount"), justify="right"),
        Column("MEMORY", lambda t: format_mb(t.get("memoryMB")), justify="right"),
        Column("DISK", lambda t: format_mb(t.get("diskSizeMB")), justify="right"),
        Column("CREATED", lambda t: local_time(t.get("createdAt"))),
        Column("UPDATED", lambda t: local_time(t.get("updatedAt")), wide=True),
        Column("SPAWNS", lambda t: t.get("spawnCount"), wide=True, justify="right"),
        Column("PUBLIC", lambda t: t.get("public"), wide=True),
    ),
    id_of=lambda t: t.get("templateID"),
    empty="no templates",
)


def template_table(templates: Iterable[Mapping[str, Any]]) -> Table:
    return TEMPLATES.table(list(templates))
