"""The root's flags (`--url`, `--api-key`, `--context`, `--debug`) anywhere on the command
line, as kubectl and docker take them: `aenv ls --url X` is `aenv --url X ls`.

Rather than moving words around in argv (which would have to know every option's arity to
tell a flag from an option's value, and what follows `--` in `exec`), every subcommand gets
the same flags as hidden options of its own: click parses them in place, and their callback
sets them on the root's `CliState`. A command with an option of the same name keeps it
(`bench --url`: a server to measure; `auth --url`: the URL to log in to)."""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any

import typer

from .state import CliState, state_of


def _set(ctx: typer.Context, field: str, value: object) -> None:
    # Unset (None, or a flag not given) leaves what the root was told.
    if value is not None and value is not False and not ctx.resilient_parsing:
        state: CliState = state_of(ctx)
        setattr(state, field, value)


def _url(ctx: typer.Context, value: str | None) -> str | None:
    _set(ctx, "url_option", value)
    return value


def _api_key(ctx: typer.Context, value: str | None) -> str | None:
    _set(ctx, "api_key_option", value)
    return value


def _context(ctx: typer.Context, value: str | None) -> str | None:
    _set(ctx, "context_option", value)
    return value


def _debug(ctx: typer.Context, value: bool) -> bool:
    _set(ctx, "debug", value)
    return value


def _flags(
    url: Annotated[str | None, typer.Option("--url", hidden=True, callback=_url)] = None,
    api_key: Annotated[
        str | None, typer.Option("--api-key", hidden=True, callback=_api_key)
    ] = None,
    context: Annotated[
        str | None, typer.Option("--context", hidden=True, callback=_context)
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", hidden=True, callback=_debug)] = False,
) -> None:
    """Only a holder of the options, built by typer as it builds every command's."""


@cache
def _global_params() -> tuple[Any, ...]:
    holder = typer.Typer()
    holder.command()(_flags)
    params = tuple(typer.main.get_command(holder).params)
    for param in params:
        param.expose_value = False  # the commands' functions do not take them
    return params


def _names(command: Any) -> set[str]:
    return {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}


def spread_global_flags(group: Any) -> None:
    """Give every command under `group` (sub-groups included) the root's flags."""
    for command in group.commands.values():
        taken = _names(command)
        for param in _global_params():
            if not taken.intersection(param.opts):
                command.params.append(param)
        if hasattr(command, "commands"):
            spread_global_flags(command)
