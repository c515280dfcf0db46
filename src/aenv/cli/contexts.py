"""`aenv context ls|use|add|rm|show`: several servers, each a named context (a URL and its
key) in the credentials file (credentials.py), one of them current; `--context NAME` or
`AENV_CONTEXT` picks another for one call (as `kubectl config use-context` / `--context`)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from .credentials import (
    Credentials,
    check_context_name,
    credentials_path,
    load_contexts,
    normalize_url,
    save_contexts,
)
from .errors import CliError
from .options import ListOutputOpt, OutputOpt, QuietOpt, note
from .output import Column, Listing, OutputFormat, print_document, print_listing, resolve_format
from .state import state_of

NameArg = Annotated[str, typer.Argument(metavar="NAME", help="The context's name.")]


def _masked(key: str) -> str:
    """Enough of a key to tell two apart, never the key (listings end up in logs)."""
    return f"{key[:8]}…" if len(key) > 12 else "…"


CONTEXTS = Listing(
    columns=(
        Column("CURRENT", lambda c: "*" if c.get("current") else ""),
        Column("NAME", lambda c: c.get("name")),
        Column("URL", lambda c: c.get("url")),
        Column("KEY", lambda c: c.get("apiKey"), wide=True),
    ),
    id_of=lambda c: c.get("name"),
    empty="no contexts: add one with `aenv auth` or `aenv context add`",
)


def context_ls(ctx: typer.Context, output: ListOutputOpt = None, quiet: QuietOpt = False) -> None:
    """List the saved contexts; `*` marks the current one.

    Examples:

    ```
    aenv context ls
    aenv context ls -o wide        # with the keys' first characters
    aenv context ls -q
    ```
    """
    stored = load_contexts(credentials_path())
    items = [
        {"name": n, "url": c.url, "current": n == stored.current, "apiKey": _masked(c.api_key)}
        for n, c in stored.contexts.items()
    ]
    print_listing(items, CONTEXTS, resolve_format(output), quiet)


def context_use(ctx: typer.Context, name: NameArg) -> None:
    """Make NAME the current context: the server every command uses from now on.

    Examples:

    ```
    aenv context use staging
    ```
    """
    path = credentials_path()
    stored = load_contexts(path)
    if name not in stored.contexts:
        raise CliError(f"no context {name!r}; see `aenv context ls`")
    stored.current = name
    save_contexts(path, stored)
    print(f"current context: {name} ({stored.contexts[name].url})")


def context_add(
    ctx: typer.Context,
    name: NameArg,
    url: Annotated[str, typer.Option("--url", help="The server's URL.")],
    api_key: Annotated[str, typer.Option("--api-key", help="Its API key.")],
    use: Annotated[bool, typer.Option("--use", help="Make it the current context.")] = False,
) -> None:
    """Save a server and its key as context NAME (replacing one of that name), without
    contacting it (`aenv auth --context NAME` checks them first).

    Examples:

    ```
    aenv context add staging --url https://aenv.staging.example.com --api-key e2b_...
    aenv context add local --url http://127.0.0.1:8000 --api-key "$(sudo cat /var/lib/aenv/secrets/api-key)" --use
    ```
    """
    path = credentials_path()
    stored = load_contexts(path)
    key = api_key.strip()
    if not key:
        raise CliError("--api-key is empty")
    stored.contexts[check_context_name(name)] = Credentials(normalize_url(url), key)
    if use or stored.current is None:
        stored.current = name
    save_contexts(path, stored)
    current = " (current)" if stored.current == name else ""
    print(f"context {name}{current}: {stored.contexts[name].url}")


def context_rm(
    ctx: typer.Context,
    names: Annotated[list[str], typer.Argument(metavar="NAME...", help="Contexts.")],
) -> None:
    """Remove saved contexts (removing the current one leaves none current).

    Examples:

    ```
    aenv context rm staging
    ```
    """
    path = credentials_path()
    stored = load_contexts(path)
    missing = [n for n in names if n not in stored.contexts]
    if missing:
        raise CliError(f"no context {missing[0]!r}; see `aenv context ls`")
    for n in names:
        del stored.contexts[n]
        if stored.current == n:
            stored.current = None
            note(f"{n} was the current context; pick one with `aenv context use NAME`")
        print(n)
    save_contexts(path, stored)


def context_show(ctx: typer.Context, output: OutputOpt = OutputFormat.table) -> None:
    """Show the context in use, and where this call's server URL and key come from.

    Examples:

    ```
    aenv context show
    aenv context show --context staging -o yaml
    AENV_CONTEXT=staging aenv context show
    ```
    """
    state = state_of(ctx)
    found = state.context()
    _, how = state.context_name()
    key, _ = state.api_key()
    info: dict[str, Any] = {
        "context": found[0] if found else None,
        "selectedBy": how if found else None,
        "url": state.url,
        "urlSource": state.url_source(),
        "keySource": state.key_source() if key else None,
        "file": str(credentials_path()),
    }
    print_document(info, output, _show_table)


def _show_table(info: dict[str, Any]) -> Table:
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    context = info["context"]
    table.add_row("context", Text(f"{context} ({info['selectedBy']})" if context else "none"))
    table.add_row("server", Text(f"{info['url']}  (from {info['urlSource']})"))
    table.add_row("key", Text(f"from {info['keySource']}" if info["keySource"] else "none"))
    table.add_row("file", Text(info["file"]))
    return table
