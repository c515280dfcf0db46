"""`aenv keys create|set|ls|rm`: the node's API keys and their quotas, edited in $AENV_HOME on the node host
(no server needed; a running server sees the change on its next request)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated

import typer

from ..domain import Quota
from ..keys import ApiKey, KeyStore
from .errors import CliError
from .options import ListOutputOpt, QuietOpt, note
from .output import Column, Listing, local_time, print_listing, resolve_format
from .state import state_of

NameArg = Annotated[str, typer.Argument(metavar="NAME", help="The key's name.")]
MaxSandboxesOpt = Annotated[
    int | None,
    typer.Option(
        "--max-sandboxes",
        min=0,
        help="At most this many of its sandboxes running (or frozen) on a node at once; "
        "past it a create gets 429. 0 with `set`: no limit.",
    ),
]
MaxMemoryOpt = Annotated[
    int | None,
    typer.Option(
        "--max-memory",
        min=0,
        metavar="MIB",
        help="At most this much memoryMB summed over those sandboxes; 0 with `set`: no limit.",
    ),
]


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


def keys_create(
    ctx: typer.Context,
    name: NameArg,
    max_sandboxes: MaxSandboxesOpt = None,
    max_memory: MaxMemoryOpt = None,
) -> None:
    """Create an API key and print it (only this once: the node keeps a hash).

    Example:

    ```
    sudo aenv keys create ci
    export E2B_API_KEY=$(sudo aenv keys create ci)
    sudo aenv keys create rl-job-7 --max-sandboxes 200 --max-memory 102400
    ```
    """
    store = _store(ctx)
    with _on_disk(store):
        key, _ = store.create(name, quota=_quota(max_sandboxes, max_memory))
    print(key)
    note(f"created API key {name!r}; it is not shown again")


def keys_set(
    ctx: typer.Context,
    name: NameArg,
    max_sandboxes: MaxSandboxesOpt = None,
    max_memory: MaxMemoryOpt = None,
) -> None:
    """Change an API key's quota (what is not given stays; 0 removes a limit). A running
    server applies it to its next create, without a restart.

    Example:

    ```
    sudo aenv keys set rl-job-7 --max-sandboxes 50
    sudo aenv keys set rl-job-7 --max-memory 0
    ```
    """
    if max_sandboxes is None and max_memory is None:
        raise CliError("nothing to set: give --max-sandboxes and/or --max-memory")
    store = _store(ctx)
    with _on_disk(store):
        old = next((k.quota for k in store.listed() if k.name == name), Quota())
        sandboxes = old.max_sandboxes if max_sandboxes is None else (max_sandboxes or None)
        memory = old.max_memory_mb if max_memory is None else (max_memory or None)
        entry = store.set_quota(name, Quota(max_sandboxes=sandboxes, max_memory_mb=memory))
    note(f"API key {entry.name!r}: {_limits(entry.listing())}")


def _quota(max_sandboxes: int | None, max_memory: int | None) -> Quota:
    return Quota(max_sandboxes=max_sandboxes or None, max_memory_mb=max_memory or None)


def _limits(item: dict[str, object]) -> str:
    n, mem = item.get("maxSandboxes"), item.get("maxMemoryMB")
    if n is None and mem is None:
        return "no limits"
    return ", ".join(
        part
        for part in (
            f"{n} sandboxes" if n is not None else "",
            f"{mem} MiB" if mem is not None else "",
        )
        if part
    )


def keys_ls(ctx: typer.Context, output: ListOutputOpt = None, quiet: QuietOpt = False) -> None:
    """List the API keys (name, the key's first characters, creation time, quota).

    Example:

    ```
    sudo aenv keys ls
    sudo aenv keys ls -o yaml
    sudo aenv keys ls -q          # names only
    ```
    """
    store = _store(ctx)
    with _on_disk(store):
        entries = sorted(store.listed(), key=lambda k: k.created)
    items = [k.listing() for k in entries]
    print_listing(items, KEYS, resolve_format(output), quiet)


KEYS = Listing(
    columns=(
        Column("NAME", lambda k: k.get("name")),
        Column("KEY", lambda k: f"{k.get('prefix')}…"),
        Column("CREATED", lambda k: local_time(k.get("created"))),
        Column("LIMITS", lambda k: _limits(dict(k))),
    ),
    id_of=lambda k: k.get("name"),
    empty="no API keys",
    boxed=True,
)


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
