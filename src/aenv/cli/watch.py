"""`--watch`/`-w` of the listings whose items change state (`ls`, `template ls`, `node ls`):
poll, and show the listing again when it changed, until Ctrl-C (exit 0, as `kubectl get -w`).

On a terminal the screen is redrawn on every poll (the relative times move on); without one
a new frame is printed only when the data changed (a blank line between tables, `---`
between YAML documents; JSON documents simply follow each other, which `jq` reads), so a
log of a watch holds one frame per change."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .output import Listing, OutputFormat, print_listing

WATCH_INTERVAL = 2.0  # seconds between polls; a control-plane list is cheap
_CLEAR = "\x1b[H\x1b[2J"
_DOCUMENTS = (OutputFormat.json, OutputFormat.yaml)


def _sleep(seconds: float) -> None:
    """The pause between polls (tests replace it to step the watch)."""
    time.sleep(seconds)


def _is_tty() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def watch_listing(
    fetch: Callable[[], Sequence[Mapping[str, Any]]],
    listing: Listing,
    fmt: OutputFormat,
    quiet: bool = False,
    interval: float = WATCH_INTERVAL,
) -> None:
    """Show `fetch()` now and again after every change, until Ctrl-C."""
    tty = _is_tty()
    last: str | None = None
    shown = False  # a frame is on stdout already (an empty table is a note on stderr)
    try:
        while True:
            items = fetch()
            key = json.dumps(items, sort_keys=True, default=str)
            if tty or key != last:
                if tty:
                    sys.stdout.write(_CLEAR)
                elif shown and (items or quiet or fmt in _DOCUMENTS):
                    sys.stdout.write(_separator(fmt, quiet))
                print_listing(items, listing, fmt, quiet)
                shown = shown or bool(items) or quiet or fmt in _DOCUMENTS
                last = key
            _sleep(interval)
    except KeyboardInterrupt:
        sys.stdout.flush()
        return


def _separator(fmt: OutputFormat, quiet: bool) -> str:
    if quiet or fmt is OutputFormat.json:
        return ""
    return "---\n" if fmt is OutputFormat.yaml else "\n"


def show_listing(
    fetch: Callable[[], Sequence[Mapping[str, Any]]],
    listing: Listing,
    fmt: OutputFormat,
    quiet: bool = False,
    watch: bool = False,
) -> None:
    """What every listing command ends with: the listing once, or watched (`-w`)."""
    if watch:
        watch_listing(fetch, listing, fmt, quiet)
    else:
        print_listing(fetch(), listing, fmt, quiet)
