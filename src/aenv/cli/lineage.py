"""`aenv tree ID`: a sandbox's lineage (`GET /sandboxes/{id}/lineage`, docs/fork-tree.md)
drawn as a tree: its ancestors down to it, then its live descendants."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import typer

from .options import OutputFormat, OutputOpt
from .output import dump
from .state import state_of


def _how(node: Mapping[str, Any]) -> str:
    """How a sandbox came from the one above it."""
    lin = node.get("lineage") or {}
    if lin.get("parentID"):
        return "fork"
    if lin.get("snapshotID"):
        return f"snapshot {lin['snapshotID']}"
    return ""


def _line(node: Mapping[str, Any], me: str) -> str:
    parts = [node["sandboxID"], f"({node.get('state', '?')})", _how(node)]
    if node["sandboxID"] == me:
        parts.append("<-")
    return "  ".join(p for p in parts if p)


def lineage_text(data: Mapping[str, Any]) -> str:
    """The tree as text: the root template, each ancestor one level deeper, the sandbox
    (marked `<-`), its descendants below it."""
    me = data["sandboxID"]
    chain = [*data.get("ancestors", []), {k: data[k] for k in ("sandboxID", "lineage")}]
    chain[-1]["state"] = "this"
    first = chain[0].get("lineage") or {}
    root = first.get("templateID") or "?"
    if chain[0].get("state") == "killed":
        root = "? (an ancestor was killed: its own origin is not kept)"
    lines = [root]
    indent = ""
    for node in chain:
        lines.append(f"{indent}└─ {_line(node, me)}")
        indent += "   "

    def below(children: list[Mapping[str, Any]], pad: str) -> None:
        for n, child in enumerate(children):
            last = n == len(children) - 1
            lines.append(f"{pad}{'└─' if last else '├─'} {_line(child, me)}")
            below(child.get("children") or [], pad + ("   " if last else "│  "))

    below(list(data.get("descendants") or []), indent)
    return "\n".join(lines) + "\n"


def tree(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox ID.")],
    output: OutputOpt = OutputFormat.table,
) -> None:
    """Show where a sandbox came from and what came from it: its template, snapshot and
    fork ancestors, oldest first, and its live descendants.

    Examples:

    ```
    aenv tree i1a2b3c4d5
    aenv tree i1a2b3c4d5 -o json | jq '.descendants[].sandboxID'
    ```
    """
    with state_of(ctx).control() as cp:
        data = cp.lineage(sandbox_id)
    if output in (OutputFormat.json, OutputFormat.yaml):
        typer.echo(dump(data, output), nl=False)
    else:
        typer.echo(lineage_text(data), nl=False)
