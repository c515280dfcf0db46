"""`aenv keys create|ls|rm`: the node's API keys, edited in $AENV_HOME on the node host
(no server needed; a running server sees the change on its next request)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated

import typer
from rich.table import Table

from ..keys import ApiKey, KeyStore
from .errors import CliError
from .options import OutputFormat, OutputOpt, note
from .output import local_time, print_listing
from .state import state_of

NameArg = Annotated[str, typer.Argument(metavar="NAME", help="The key's name.")]


def _store(ctx: typer.Context) -> KeyStore:
    return KeyStore.of(state_of(ctx).settings())


@contextlib.contextmanager
def _on_disk(store: KeyStore) -> Iterator[None]:
    """An OS error (most often: not root on a node owned by root) as one line."""
    try:
        yield
    except OSError as exc:
        where = exc.filename or store.path
        raise CliError(f"cannot use {where}: {exc.strerror or exc}") from None


def keys_create(ctx: typer.Context, name: NameArg) -> None:
    """Create an API key and print it (only this once: the node keeps a hash).

    Example:

    ```
    sudo aenv keys create ci
    export E2B_API_KEY=$(sudo aenv keys create ci)
    ```
    """
    store = _store(ctx)
    with _on_disk(store):
        key, _ = store.create(name)
    print(key)
    note(f"created API key {name!r}; it is not shown again")


def keys_ls(ctx: typer.Context, output: OutputOpt = OutputFormat.table) -> None:
    """List the API keys (name, the key's first characters, creation time).

    Example:

    ```
    sudo aenv keys ls
    sudo aenv keys ls -o json
    ```
    """
    store = _store(ctx)
    with _on_disk(store):
        entries = sorted(store.listed(), key=lambda k: k.created)
    items = [k.listing() for k in entries]
    print_listing(items, as_json=output is OutputFormat.json, empty="no API keys", table=_table)


def _table(items: list[dict[str, str]]) -> Table:
    table = Table("NAME", "KEY", "CREATED")
    for k in items:
        table.add_row(k["name"], k["prefix"] + "…", local_time(k["created"]))
    return table


def keys_rm(
    ctx: typer.Context,
    name: NameArg,
    force: Annotated[
        bool, typer.Option("--force", help="Revoke it even if it is the last key.")
    ] = False,
) -> None:
    """Revoke an API key; requests with it get 401 from now on, without a restart.

    Example:

    ```
    sudo aenv keys rm ci
    ```
    """
    settings = state_of(ctx).settings()
    store = KeyStore.of(settings)
    with _on_disk(store):
        # With AENV_API_KEY the control plane stays open without any stored key.
        entry: ApiKey = store.remove(name, allow_last=force or bool(settings.api_key))
    note(f"revoked API key {entry.name!r} ({entry.prefix}…)")
