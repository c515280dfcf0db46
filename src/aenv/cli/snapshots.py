"""`aenv snapshot create|ls|rm` and `aenv fork`."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from .client import url_segment
from .options import JsonFlagOpt, ListOutputOpt, QuietOpt
from .output import Column, Listing, console, local_time, print_listing, resolve_format
from .state import state_of


def snapshot_create(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox ID.")],
    name: Annotated[str | None, typer.Option("--name", "-n", help="A name to create from.")] = None,
    filesystem: Annotated[
        bool,
        typer.Option(
            "--filesystem", "-f", help="Files only: sandboxes made from it boot fresh on them."
        ),
    ] = False,
) -> None:
    """Snapshot a sandbox (files, memory, processes); it keeps running. Prints the id.

    A snapshot is a template: start sandboxes from it with `aenv start SNAPSHOT`.

    Examples:

    ```
    aenv snapshot create i1a2b3c4d5 --name warm-py
    aenv snapshot create i1a2b3c4d5 --filesystem     # files only
    aenv start warm-py
    ```
    """
    body: dict[str, Any] = {} if name is None else {"name": name}
    if filesystem:
        body["memory"] = False
    with state_of(ctx).control() as cp:
        resp = cp.request(
            "POST", f"/sandboxes/{url_segment(sandbox_id)}/snapshots", json=body, ok=(201,)
        )
    data = resp.json()
    print(data["snapshotID"])
    timing = resp.headers.get("server-timing")
    if timing:
        console(stderr=True).print(f"stages: {timing}", style="dim", markup=False)


def snapshot_ls(
    ctx: typer.Context,
    sandbox_id: Annotated[
        str | None, typer.Option("--sandbox-id", "-s", help="Only snapshots of this sandbox.")
    ] = None,
    output: ListOutputOpt = None,
    quiet: QuietOpt = False,
    json_out: JsonFlagOpt = False,
) -> None:
    """List snapshots.

    Examples:

    ```
    aenv snapshot ls
    aenv snapshot ls --sandbox-id i1a2b3c4d5 -o json
    aenv snapshot ls -q
    ```
    """
    params = {"sandboxID": sandbox_id} if sandbox_id else {}
    items: list[dict[str, Any]] = []
    with state_of(ctx).control() as cp:
        token: str | None = None
        while True:
            q = dict(params, **({"nextToken": token} if token else {}))
            resp = cp.request("GET", "/snapshots", params=q)
            items.extend(resp.json())
            token = resp.headers.get("x-next-token")
            if not token:
                break
    print_listing(items, SNAPSHOTS, resolve_format(output, json_flag=json_out), quiet)


def snapshot_rm(
    ctx: typer.Context,
    snapshots: Annotated[
        list[str], typer.Argument(metavar="SNAPSHOT...", help="Snapshot IDs or names.")
    ],
) -> None:
    """Delete snapshots (they are templates: this is `aenv template rm`); prints each one.

    Sandboxes already started from a snapshot keep running.

    Examples:

    ```
    aenv snapshot rm warm-py
    aenv snapshot ls -q | xargs aenv snapshot rm
    ```
    """
    from .templates import delete_templates

    delete_templates(ctx, snapshots)


SNAPSHOTS = Listing(
    columns=(
        Column("SNAPSHOT", lambda s: s.get("snapshotID"), key=True),
        Column("MODE", lambda s: s.get("mode") or "full"),
        Column("NAMES", lambda s: ", ".join(s.get("names") or []), fold=True),
        Column("SANDBOX", lambda s: s.get("sandboxID"), wide=True),
        Column("CREATED", lambda s: local_time(s.get("createdAt")), wide=True),
    ),
    id_of=lambda s: s.get("snapshotID"),
    empty="no snapshots",
)


def fork(
    ctx: typer.Context,
    sandbox_id: Annotated[
        str, typer.Argument(metavar="ID", help="Sandbox ID, or a snapshot's ID or name.")
    ],
    count: Annotated[int, typer.Option("--count", "-c", min=1, max=20, help="Children.")] = 1,
    timeout: Annotated[
        int | None, typer.Option("--timeout", "-t", min=1, help="Children's lifetime (s).")
    ] = None,
) -> None:
    """Fork a running or paused sandbox into N children that continue from its memory.

    A files-only paused sandbox's children boot fresh on its files. Given a snapshot
    instead, N sandboxes are created from it in one call. Prints the children's ids; a
    failed child is reported on stderr and makes the exit code 1.

    Examples:

    ```
    aenv fork i1a2b3c4d5 --count 4 --timeout 600
    aenv fork my-snapshot --count 8     # 8 sandboxes from a named snapshot
    ```
    """
    body: dict[str, Any] = {"count": count}
    if timeout is not None:
        body["timeout"] = timeout
    with state_of(ctx).control() as cp:
        resp = cp.request(
            "POST", f"/sandboxes/{url_segment(sandbox_id)}/fork", json=body, ok=(201,)
        )
    failed = 0
    for entry in resp.json():
        if entry.get("sandbox"):
            print(entry["sandbox"]["sandboxID"])
        else:
            failed += 1
            err = entry.get("error") or {}
            console(stderr=True).print(
                f"aenv: a child failed: {err.get('message', 'unknown error')}", markup=False
            )
    if failed:
        raise typer.Exit(1)
