"""`aenv bench`: runs the benchmark harness (the `bench` package, beside `src/`) and prints
its table. The harness is imported when the command runs, not when the CLI starts.

The harness is not part of the installed package: it measures this server against raw runsc
on the same machine and keeps its results (bench/results/, the README's table) in the
checkout, so it runs from a checkout, found beside this module (an editable install) or in
the current directory."""

from __future__ import annotations

import asyncio
import fnmatch
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from .. import DISTRIBUTION
from .errors import CliError, missing_server_extra
from .state import state_of


class RichProgress:
    """The harness's progress callbacks on a rich progress bar (stderr)."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        from .output import console

        self.console = console(stderr=True)
        self._bar = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self._task: Any = None
        self._t0 = time.monotonic()

    def __enter__(self) -> RichProgress:
        self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._finish()
        self._bar.stop()

    def _finish(self) -> None:
        if self._task is not None:
            task = self._bar.tasks[-1]
            self._bar.update(self._task, completed=task.total)
            self._task = None

    def step(self, label: str, total: int) -> None:
        self._finish()
        self._task = self._bar.add_task(label, total=max(1, total))

    def advance(self, n: int = 1) -> None:
        if self._task is not None:
            self._bar.advance(self._task, n)

    def log(self, message: str) -> None:
        from rich.markup import escape

        self._bar.console.print(f"[dim]{escape(message)}[/]", highlight=False)


def checkout_with_bench(candidates: tuple[Path, ...] | None = None) -> Path | None:
    """The checkout whose `bench/` to run: this module's own (src/aenv/cli/bench.py in an
    editable install) or the current directory; None outside a checkout."""
    if candidates is None:
        candidates = (Path(__file__).resolve().parents[3], Path.cwd())
    for root in candidates:
        if (root / "bench" / "harness.py").is_file():
            return root.resolve()
    return None


def load_bench() -> None:
    """Makes the checkout's `bench` importable, or fails with one line saying where it runs."""
    root = checkout_with_bench()
    if root is None:
        raise CliError(
            "`aenv bench` runs from a checkout of the aenv repository (the harness in bench/ "
            "is not installed with the package): run `make bench` there"
        )
    # Appended, not prepended: the checkout's other directories must not shadow anything.
    if str(root) not in sys.path:
        sys.path.append(str(root))


def _print_table(doc: dict[str, Any]) -> None:
    from rich.table import Table

    from bench import report

    from .output import print_table

    table = Table(title="aenv bench" + f" ({doc.get('config', {}).get('mode', '')})")
    for i, header in enumerate(report.HEADERS):
        table.add_column(header, justify="right" if 0 < i < 6 else "left", no_wrap=i == 0)
    table.add_column("note", overflow="fold", max_width=60)
    for cells in report.table_rows(doc):
        *main, note = cells
        met = main[7]
        style = {"✔": "green", "✘": "red"}.get(met, "")
        main[7] = f"[{style}]{met}[/]" if style else met
        table.add_row(*main, f"[dim]{note}[/]" if note else "")
    print_table(table)


def bench(
    ctx: typer.Context,
    quick: Annotated[
        bool, typer.Option("--quick", help="Few samples per row (about 3 minutes).")
    ] = False,
    url: Annotated[
        str | None,
        typer.Option(
            "--url", help="Measure this server instead of starting one (default: start one)."
        ),
    ] = None,
    api_key: Annotated[
        str | None, typer.Option("--api-key", help="API key of the --url server.")
    ] = None,
    cold_url: Annotated[
        str | None,
        typer.Option(
            "--cold-url",
            help="With --url: a server with AENV_NET_POOL_SIZE=0 AENV_HIBERNATE_AFTER=0 for the "
            "no-pool and hibernate rows.",
        ),
    ] = None,
    baseline: Annotated[
        bool, typer.Option("--baseline/--no-baseline", help="Also time raw runsc.")
    ] = True,
    only: Annotated[
        str | None,
        typer.Option(
            "--only",
            metavar="ROWS",
            help="Comma-separated row names (or shell patterns: 'qemu_*') to measure.",
        ),
    ] = None,
    results_dir: Annotated[
        Path | None,
        typer.Option("--results-dir", help="Where latest.json goes (default: bench/results)."),
    ] = None,
    logs: Annotated[
        Path | None,
        typer.Option("--logs", metavar="DIR", help="Keep the started servers' logs in DIR."),
    ] = None,
) -> None:
    """Benchmark a server through its HTTP API (and raw runsc as the baseline); writes
    bench/results/latest.json and prints the table.

    Runs from a checkout of the repository (the harness, bench/, is not installed).

    Examples:

    ```
    sudo aenv bench --quick
    aenv bench --url http://10.0.0.5:8000
    ```
    """
    load_bench()
    try:
        from bench import harness, report
        from bench.client import BenchError
    except ModuleNotFoundError as exc:
        hint = missing_server_extra(exc, DISTRIBUTION)
        raise CliError(hint or f"the benchmark harness (bench/) cannot be loaded: {exc}") from None
    except ImportError as exc:
        raise CliError(f"the benchmark harness (bench/) cannot be loaded: {exc}") from None
    state = state_of(ctx)
    # The global `aenv --url/--api-key` count too; without any URL the bench starts a server.
    url = url or state.url_option
    if url:
        api_key = api_key or state.api_key_option or state.api_key()[0]
        if not api_key:
            raise CliError("--url needs --api-key (or AENV_API_KEY)")
    if (not url or baseline) and os.geteuid() != 0:
        raise CliError(
            "the bench needs root (it starts servers and runs runsc); "
            "use --url with --no-baseline otherwise"
        )
    rows = select_rows(only, report.REQUIRED) if only else None
    opts = harness.Options(
        quick=quick,
        url=url,
        api_key=api_key,
        cold_url=cold_url,
        baseline=baseline,
        only=rows,
        results_dir=results_dir or harness.RESULTS_DIR,
        logs_dir=logs,
    )
    t0 = time.monotonic()
    with RichProgress() as progress:
        try:
            doc = asyncio.run(harness.run(opts, progress))
        except BenchError as exc:
            raise CliError(str(exc)) from None
        except asyncio.CancelledError:  # SIGTERM/SIGHUP, after the clean-up
            sys.stderr.write("aenv: bench stopped; everything it started was removed\n")
            raise typer.Exit(143) from None
    _print_table(doc)
    # A partial run (--only) writes only its dated copy, never latest.json.
    out = opts.results_dir / ("latest.json" if opts.only is None else "<date>.json")
    sys.stderr.write(
        f"aenv: bench finished in {time.monotonic() - t0:.0f}s; results in {out} "
        f"(Markdown: .venv/bin/python bench/report.py)\n"
    )


def select_rows(only: str, known: list[str] | tuple[str, ...]) -> set[str]:
    """The rows `--only` names: each comma-separated item a row or a shell pattern over
    the rows; one that names none is an error (a typo must not measure nothing)."""
    rows: set[str] = set()
    unknown: list[str] = []
    for item in (r.strip() for r in only.split(",")):
        if not item:
            continue
        hits = fnmatch.filter(known, item)
        if hits:
            rows.update(hits)
        else:
            unknown.append(item)
    if unknown:
        raise CliError(f"unknown rows: {', '.join(unknown)}")
    if not rows:
        raise CliError("--only names no rows")
    return rows
