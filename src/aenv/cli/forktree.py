"""`aenv diff`, `aenv apply`: what a sandbox changed since its fork point (or a snapshot, or
another sandbox), and taking one sandbox's changes into another (docs/fork-tree.md)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from .client import url_segment
from .errors import CliError
from .options import OutputFormat, OutputOpt
from .output import dump
from .state import state_of

_LETTER = {"added": "A", "changed": "M", "deleted": "D"}

BaseOpt = Annotated[
    str | None,
    typer.Option("--base", "-b", help="fork-point (default), a snapshot or a sandbox ID."),
]
ExcludeOpt = Annotated[
    list[str] | None,
    typer.Option("--exclude", "-x", metavar="GLOB", help="Leave out matching paths (repeatable)."),
]
AllFilesOpt = Annotated[
    bool,
    typer.Option("--all-files", help="Do not leave out caches and aenv's own files."),
]


def _query(base: str | None, exclude: list[str] | None, all_files: bool) -> list[tuple[str, str]]:
    q: list[tuple[str, str]] = [("exclude", x) for x in exclude or []]
    if base:
        q.append(("base", base))
    if all_files:
        q.append(("defaultExcludes", "false"))
    return q


def diff(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox ID.")],
    other: Annotated[
        str | None,
        typer.Argument(metavar="[BASE]", help="Compare with this sandbox or snapshot instead."),
    ] = None,
    base: BaseOpt = None,
    exclude: ExcludeOpt = None,
    all_files: AllFilesOpt = False,
    patch: Annotated[bool, typer.Option("--patch", "-p", help="A unified diff.")] = False,
    tar: Annotated[
        Path | None,
        typer.Option("--tar", metavar="FILE", help="The added and changed files as a tar."),
    ] = None,
    output: OutputOpt = OutputFormat.table,
) -> None:
    """Show what a sandbox changed since its fork point, a snapshot or another sandbox:
    one line per path (A added, M changed, D deleted), a patch, or a tar.

    Examples:

    ```
    aenv diff i1a2b3c4d5                  # since the fork that made it
    aenv diff i1a2b3c4d5 i9f8e7d6c5       # what it has that its sibling has not
    aenv diff i1a2b3c4d5 --patch > fix.diff && git apply fix.diff
    aenv diff i1a2b3c4d5 --tar changes.tar -x '*.log'
    ```
    """
    if other is not None and base is not None:
        raise CliError("give the base as an argument or with --base, not both")
    params = _query(other or base, exclude, all_files)
    path = f"/sandboxes/{url_segment(sandbox_id)}/diff"
    with state_of(ctx).control() as cp:
        if patch or tar is not None:
            params.append(("format", "patch" if patch else "tar"))
            with cp.stream("GET", path, params=tuple(params)) as resp:
                if tar is not None:
                    with tar.open("wb") as f:
                        for chunk in resp.iter_bytes():
                            f.write(chunk)
                else:
                    for chunk in resp.iter_bytes():
                        sys.stdout.buffer.write(chunk)
                    sys.stdout.buffer.flush()
            return
        data = cp.request("GET", path, params=tuple(params)).json()
    if output in (OutputFormat.json, OutputFormat.yaml):
        typer.echo(dump(data, output), nl=False)
        return
    for c in data:
        typer.echo(f"{_LETTER.get(c['change'], '?')} {c['path']}")


def apply(
    ctx: typer.Context,
    target: Annotated[str, typer.Argument(metavar="ID", help="The sandbox to change.")],
    source: Annotated[
        str, typer.Option("--from", "-f", metavar="SOURCE", help="Whose changes to take.")
    ],
    base: BaseOpt = None,
    paths: Annotated[
        list[str] | None,
        typer.Option("--path", metavar="PATH", help="Take only these paths (repeatable)."),
    ] = None,
    exclude: ExcludeOpt = None,
    all_files: AllFilesOpt = False,
    strategy: Annotated[
        str | None,
        typer.Option(
            "--strategy",
            help="Where both changed a path: ours (keep the target's) or theirs (take it).",
        ),
    ] = None,
    output: OutputOpt = OutputFormat.table,
) -> None:
    """Take another sandbox's changes since a base (default: its fork point) into a
    running sandbox — typically the best child of a fork into the parent. Paths both
    changed are refused, listed, unless --strategy says whose to keep.

    Examples:

    ```
    aenv apply PARENT --from WINNER
    aenv apply PARENT --from WINNER --path /home/user/repo/src --strategy theirs
    ```
    """
    if strategy not in (None, "ours", "theirs"):
        raise CliError("--strategy must be ours or theirs")
    body: dict[str, Any] = {"from": source, "paths": paths or [], "exclude": exclude or []}
    if base:
        body["base"] = base
    if all_files:
        body["defaultExcludes"] = False
    if strategy:
        body["strategy"] = strategy
    with state_of(ctx).control() as cp:
        resp = cp.request(
            "POST", f"/sandboxes/{url_segment(target)}/apply", json=body, ok=(200, 409)
        )
    data = resp.json()
    if resp.status_code == 409:
        lines = [str(data.get("message", "conflict")), *(f"  C {p}" for p in data.get("paths", []))]
        raise CliError("\n".join(lines), status=409)
    if output in (OutputFormat.json, OutputFormat.yaml):
        typer.echo(dump(data, output), nl=False)
        return
    for c in data["applied"]:
        typer.echo(f"{_LETTER.get(c['change'], '?')} {c['path']}")
    for p in data["conflicts"]:
        typer.echo(f"C {p} ({'kept' if strategy == 'ours' else 'taken'})")


def rollback(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox ID.")],
    snapshot_id: Annotated[
        str, typer.Argument(metavar="SNAPSHOT", help="One of its own memory snapshots.")
    ],
) -> None:
    """Bring a running sandbox back to one of its snapshots — files, memory and processes
    — keeping its id, address, tokens and URLs (what it did since is dropped).

    Example:

    ```
    SNAP=$(aenv snapshot create i1a2b3c4d5)
    aenv rollback i1a2b3c4d5 "$SNAP"
    ```
    """
    with state_of(ctx).control() as cp:
        cp.request(
            "POST",
            f"/sandboxes/{url_segment(sandbox_id)}/rollback",
            json={"snapshotID": snapshot_id},
            timeout=300,
        )
    typer.echo(f"{sandbox_id} rolled back to {snapshot_id}")
