"""Options and argument parsing shared by several commands."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .errors import CliError
from .output import OutputFormat

__all__ = ["OutputFormat"]  # defined with the renderers (output.py); re-exported here

UserOpt = Annotated[
    str | None, typer.Option("--user", "-u", help="Run as this user (default: the sandbox's).")
]
CwdOpt = Annotated[str | None, typer.Option("--cwd", "-w", help="Working directory.")]
EnvOpt = Annotated[
    list[str] | None,
    typer.Option("--env", "-e", metavar="KEY=VALUE", help="Environment variable (repeatable)."),
]
OutputOpt = Annotated[
    OutputFormat, typer.Option("--output", "-o", help="Output format: table, wide, json or yaml.")
]
# The listings' options: every `ls` takes the same four (`-o`, `-q`, the hidden `--json` of
# the commands that had it, and `-w` where what is listed changes state).
ListOutputOpt = Annotated[
    OutputFormat | None,
    typer.Option(
        "--output",
        "-o",
        help="table, wide (more columns), json or yaml.",
        show_default=False,
    ),
]
AutoOutputOpt = Annotated[
    OutputFormat | None,
    typer.Option(
        "--output",
        "-o",
        help="table, wide (more columns), json or yaml (default: table on a terminal, json "
        "when piped).",
        show_default=False,
    ),
]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="Only the IDs, one per line (for xargs).")
]
JsonFlagOpt = Annotated[
    bool, typer.Option("--json", hidden=True, help="Deprecated: the same as -o json.")
]
WatchOpt = Annotated[
    bool,
    typer.Option(
        "--watch", "-w", help="Redraw whenever it changes (polls every 2 s) until Ctrl-C."
    ),
]


def stdout_is_tty() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def stdin_is_tty() -> bool:
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False


def wants_json(output: OutputFormat | None) -> bool:
    """JSON when asked for, or by default when stdout is not a terminal (a pipe, a file)."""
    if output is None:
        return not stdout_is_tty()
    return output in (OutputFormat.json, OutputFormat.yaml)


def pairs(values: list[str] | None, option: str) -> dict[str, str]:
    """`KEY=VALUE` option values as a dict (a value may be empty or hold `=`)."""
    out: dict[str, str] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"{option} expects KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def note(message: str) -> None:
    """An `aenv: ...` line on stderr that is not an error."""
    sys.stderr.write(f"aenv: {message}\n")
    sys.stderr.flush()
