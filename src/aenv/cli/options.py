"""Options and argument parsing shared by several commands."""

from __future__ import annotations

import enum
import sys
from typing import Annotated

import typer

from .errors import CliError


class OutputFormat(enum.StrEnum):
    table = "table"
    json = "json"


UserOpt = Annotated[
    str | None, typer.Option("--user", "-u", help="Run as this user (default: the sandbox's).")
]
CwdOpt = Annotated[str | None, typer.Option("--cwd", "-w", help="Working directory.")]
EnvOpt = Annotated[
    list[str] | None,
    typer.Option("--env", "-e", metavar="KEY=VALUE", help="Environment variable (repeatable)."),
]
OutputOpt = Annotated[OutputFormat, typer.Option("--output", "-o", help="Output format.")]
AutoOutputOpt = Annotated[
    OutputFormat | None,
    typer.Option(
        "--output",
        "-o",
        help="Output format (default: table on a terminal, json when piped).",
        show_default=False,
    ),
]


def stdout_is_tty() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def wants_json(output: OutputFormat | None) -> bool:
    """JSON when asked for, or by default when stdout is not a terminal (a pipe, a file)."""
    if output is None:
        return not stdout_is_tty()
    return output is OutputFormat.json


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
