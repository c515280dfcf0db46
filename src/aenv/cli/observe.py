"""`aenv logs ID [-f]` (a sandbox's log, followed by polling) and `aenv top` (live CPU and
memory per sandbox)."""

from __future__ import annotations

import enum
import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from .client import ControlPlane, url_segment
from .errors import CliError
from .options import OutputFormat, note, pairs, stdout_is_tty
from .output import (
    console,
    dump,
    format_metadata,
    id_width,
    parse_time,
    print_table,
    relative_time,
)

# -- logs -----------------------------------------------------------------------------------

LEVEL_STYLES = {"debug": "dim", "info": "", "warn": "yellow", "error": "bold red"}
PAGE = 1000  # the server's bound on one answer


class LinesFormat(enum.StrEnum):
    """`logs -o`: a log is a stream of lines, not a document (no wide, no yaml)."""

    table = "table"
    json = "json"


def _ms(entry: Mapping[str, Any]) -> int:
    dt = parse_time(entry.get("timestamp"))
    return int(dt.timestamp() * 1000) if dt is not None else 0


def _key(entry: Mapping[str, Any]) -> str:
    return json.dumps(entry, sort_keys=True)


def format_log_line(entry: Mapping[str, Any]) -> Text:
    """`2026-12-02 10:04:05.123 INFO  message k=v` (local time)."""
    dt = parse_time(entry.get("timestamp"))
    when = dt.astimezone().strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] if dt else "-"
    level = str(entry.get("level") or "info")
    fields = entry.get("fields") or {}
    extra = " ".join(f"{k}={v}" for k, v in fields.items()) if isinstance(fields, dict) else ""
    text = Text(f"{when} ")
    text.append(f"{level.upper():<5}", style=LEVEL_STYLES.get(level, ""))
    text.append(f" {entry.get('message', '')}")
    if extra:
        text.append(f" {extra}", style="dim")
    return text


class LogCursor:
    """Forward pages of `GET /v2/sandboxes/{id}/logs` from a cursor (milliseconds, which
    the server takes inclusively): each entry is yielded once, however many polls see it."""

    def __init__(self, cp: ControlPlane, sandbox_id: str, params: dict[str, str]) -> None:
        self.cp = cp
        self.path = f"/v2/sandboxes/{url_segment(sandbox_id)}/logs"
        self.params = params
        self.cursor: int | None = None
        self._seen_at_cursor: set[str] = set()

    def fetch(self, **extra: str) -> list[dict[str, Any]]:
        params = {**self.params, "limit": str(PAGE), **extra}
        data = self.cp.request("GET", self.path, params=params).json()
        logs = data.get("logs") if isinstance(data, dict) else None
        return [e for e in logs or [] if isinstance(e, dict)]

    def skip_to(self, entries: Sequence[dict[str, Any]]) -> None:
        """Mark `entries` (already shown) as seen."""
        for e in entries:
            self._advance(e)

    def _advance(self, e: dict[str, Any]) -> bool:
        ms, key = _ms(e), _key(e)
        if self.cursor is not None and ms < self.cursor:
            return False
        if ms == self.cursor:
            if key in self._seen_at_cursor:
                return False
            self._seen_at_cursor.add(key)
        else:
            self.cursor, self._seen_at_cursor = ms, {key}
        return True

    def new(self) -> list[dict[str, Any]]:
        """Every entry not seen yet, page after page."""
        out: list[dict[str, Any]] = []
        while True:
            extra = {"direction": "forward"}
            if self.cursor is not None:
                extra["cursor"] = str(self.cursor)
            page = self.fetch(**extra)
            fresh = [e for e in page if self._advance(e)]
            out.extend(fresh)
            if len(page) < PAGE or not fresh:
                return out


def logs(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox ID.")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new entries (Ctrl-C stops).")
    ] = False,
    tail: Annotated[
        int | None, typer.Option("--tail", "-n", min=1, max=PAGE, help="Only the last N.")
    ] = None,
    level: Annotated[
        str | None, typer.Option("--level", "-l", help="At least: debug, info, warn or error.")
    ] = None,
    search: Annotated[
        str | None, typer.Option("--search", help="Only entries whose message has this.")
    ] = None,
    output: Annotated[
        LinesFormat, typer.Option("--output", "-o", help="table: lines; json: JSON lines.")
    ] = LinesFormat.table,
    interval: Annotated[
        float, typer.Option("--interval", min=0.2, help="Seconds between polls with -f.")
    ] = 1.0,
) -> None:
    """Print a sandbox's log: the node's lifecycle events and envd's (processes started,
    their exits). With -f, keep polling until Ctrl-C or the sandbox is gone.

    Examples:

    ```
    aenv logs i1a2b3c4d5
    aenv logs i1a2b3c4d5 -f --level warn
    aenv logs i1a2b3c4d5 -n 20 -o json | jq .message
    ```
    """
    from .state import state_of

    if level is not None and level not in LEVEL_STYLES:
        raise CliError(f"--level takes debug, info, warn or error, got {level!r}")
    params: dict[str, str] = {}
    if level:
        params["level"] = level
    if search:
        params["search"] = search
    out = console()
    as_json = output is LinesFormat.json

    def show(entries: Sequence[dict[str, Any]]) -> None:
        for e in entries:
            if as_json:
                sys.stdout.write(json.dumps(e) + "\n")
            elif out.is_terminal:
                out.print(format_log_line(e), highlight=False, soft_wrap=True)
            else:
                sys.stdout.write(format_log_line(e).plain + "\n")
        sys.stdout.flush()

    with state_of(ctx).control() as cp:
        cursor = LogCursor(cp, sandbox_id, params)
        if tail is not None:
            last = list(reversed(cursor.fetch(direction="backward", limit=str(tail))))[-tail:]
            cursor.skip_to(last)
            show(last)
        else:
            show(cursor.new())
        if not follow:
            return
        polls = 0
        try:
            while True:
                time.sleep(interval)
                polls += 1
                try:
                    show(cursor.new())
                    if polls % 5 == 0:
                        cp.get_sandbox(sandbox_id)
                except CliError as exc:
                    if exc.status == 404:
                        note(f"sandbox {sandbox_id} is gone")
                        return
                    raise
        except KeyboardInterrupt:
            return


# -- top ------------------------------------------------------------------------------------

METRICS_BATCH = 100  # the server's bound of sandbox_ids in one request


def _pct(used: Any, total: Any) -> float | None:
    if isinstance(used, int | float) and isinstance(total, int | float) and total > 0:
        return 100.0 * used / total
    return None


def _bytes(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    mb = value / (1024 * 1024)
    return f"{mb:.0f} MB" if mb < 10240 else f"{mb / 1024:.1f} GB"


def snapshot_usage(cp: ControlPlane, metadata: dict[str, str]) -> list[dict[str, Any]]:
    """The running sandboxes, each with its latest `metrics` (None until the node has
    sampled it)."""
    boxes = cp.list_sandboxes(state="running", metadata=metadata)
    ids = [str(b["sandboxID"]) for b in boxes if b.get("sandboxID")]
    metrics: dict[str, Any] = {}
    for i in range(0, len(ids), METRICS_BATCH):
        chunk = ",".join(ids[i : i + METRICS_BATCH])
        data = cp.request("GET", "/sandboxes/metrics", params={"sandbox_ids": chunk}).json()
        if isinstance(data, dict) and isinstance(data.get("sandboxes"), dict):
            metrics.update(data["sandboxes"])
    return [dict(b, metrics=metrics.get(str(b.get("sandboxID")))) for b in boxes]


def _sort_key(sort: str) -> Any:
    def key(row: dict[str, Any]) -> Any:
        m = row.get("metrics") or {}
        if sort == "cpu":
            return -(m.get("cpuUsedPct") or 0.0)
        if sort == "mem":
            return -(m.get("memUsed") or 0)
        return str(row.get("sandboxID"))

    return key


def top_table(rows: Sequence[dict[str, Any]], sort: str = "cpu") -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("ID", no_wrap=True, min_width=id_width(rows))
    table.add_column("TEMPLATE", no_wrap=True)
    for col in ("CPU%", "VCPU", "MEM", "MEM%", "DISK", "DISK%"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("ENDS", no_wrap=True)
    table.add_column("METADATA", overflow="fold")
    for r in sorted(rows, key=_sort_key(sort)):
        m = r.get("metrics") or {}
        cpu = m.get("cpuUsedPct")
        mem_pct = _pct(m.get("memUsed"), m.get("memTotal"))
        disk_pct = _pct(m.get("diskUsed"), m.get("diskTotal"))
        style = "red" if isinstance(cpu, int | float) and cpu >= 90 else ""
        table.add_row(
            Text(str(r.get("sandboxID"))),
            Text(str(r.get("alias") or r.get("templateID") or "-")),
            Text("-" if cpu is None else f"{cpu:.1f}", style=style),
            Text(str(m.get("cpuCount") or r.get("cpuCount") or "-")),
            Text(_bytes(m.get("memUsed")) if m else "-"),
            Text("-" if mem_pct is None else f"{mem_pct:.0f}"),
            Text(_bytes(m.get("diskUsed")) if m else "-"),
            Text("-" if disk_pct is None else f"{disk_pct:.0f}"),
            Text(relative_time(r.get("endAt"))),
            Text(format_metadata(r.get("metadata"))),
        )
    return table


def _summary(rows: Sequence[dict[str, Any]], url: str) -> Text:
    cpu = sum((r.get("metrics") or {}).get("cpuUsedPct") or 0.0 for r in rows)
    mem = sum((r.get("metrics") or {}).get("memUsed") or 0 for r in rows)
    return Text(
        f"{time.strftime('%H:%M:%S')}  {url}  {len(rows)} running; CPU {cpu:.1f}% "
        f"(sum of sandboxes), memory {_bytes(mem)} used",
        style="bold",
    )


def top(
    ctx: typer.Context,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
    interval: Annotated[
        float, typer.Option("--interval", "-n", min=0.5, help="Seconds between refreshes.")
    ] = 2.0,
    sort: Annotated[str, typer.Option("--sort", "-s", help="Order: cpu, mem or id.")] = "cpu",
    metadata: Annotated[
        list[str] | None,
        typer.Option("--metadata", "-m", metavar="KEY=VALUE", help="Filter by metadata."),
    ] = None,
    output: Annotated[
        OutputFormat,
        typer.Option("--output", "-o", help="json or yaml: one frame, then exit."),
    ] = OutputFormat.table,
) -> None:
    """Live CPU, memory and disk of the running sandboxes, refreshed every 2 s (Ctrl-C
    quits). Metrics are the node's latest sample ("-" until the first one).

    Without a terminal, a frame is printed per refresh (use --once for one).

    Examples:

    ```
    aenv top
    aenv top --sort mem -m team=ml
    aenv top --once
    aenv top -o json | jq '.[] | {sandboxID, metrics}'
    ```
    """
    from .state import state_of

    if sort not in ("cpu", "mem", "id"):
        raise CliError(f"--sort takes cpu, mem or id, got {sort!r}")
    meta = pairs(metadata, "--metadata")
    state = state_of(ctx)
    with state.control() as cp:
        if output in (OutputFormat.json, OutputFormat.yaml):
            sys.stdout.write(dump(snapshot_usage(cp, meta), output))
            return

        def frame() -> Group:
            rows = snapshot_usage(cp, meta)
            return Group(_summary(rows, state.url), top_table(rows, sort))

        if once:
            group = frame()
            print_table_group(group)
            return
        try:
            if not stdout_is_tty():
                while True:
                    print_table_group(frame())
                    sys.stdout.write("\n")
                    time.sleep(interval)
            from rich.live import Live

            with Live(frame(), console=console(), auto_refresh=False, screen=False) as live:
                while True:
                    time.sleep(interval)
                    live.update(frame(), refresh=True)
        except KeyboardInterrupt:
            return


def print_table_group(group: Group) -> None:
    """A frame on stdout (a summary line and a table), plain text without a terminal."""
    summary, table = group.renderables
    con = console()
    if con.is_terminal:
        con.print(summary)
    else:
        sys.stdout.write(str(summary) + "\n")
    assert isinstance(table, Table)
    print_table(table)
