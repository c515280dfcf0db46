"""`aenv node ls|drain|undrain`: the nodes behind a gateway (or the one node itself)."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer
from rich.table import Table

from .client import url_segment
from .output import print_json, print_listing
from .state import state_of

NodeArg = Annotated[str, typer.Argument(metavar="NODE", help="Node ID.")]
# A drain hibernates and uploads every sandbox of the node.
DRAIN_TIMEOUT = 3600.0


def node_ls(
    ctx: typer.Context,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the nodes and their status, sandboxes and free memory.

    Examples:

    ```
    aenv node ls
    aenv --url http://gateway:8080 node ls --json
    ```
    """
    with state_of(ctx).control() as cp:
        items = cp.request("GET", "/nodes").json()
    print_listing(items, as_json=json_out, empty="no nodes", table=_node_table)


def _node_table(items: list[dict[str, Any]]) -> Table:
    table = Table("NODE", "STATUS", "SANDBOXES", "FREE MEMORY", "URL")
    for n in items:
        free = n.get("freeMemoryMB")
        table.add_row(
            str(n.get("nodeID")),
            str(n.get("status")),
            str(n.get("sandboxCount", "")),
            "" if free is None else f"{free} MiB",
            str(n.get("url", "")),
        )
    return table


def node_drain(
    ctx: typer.Context,
    node: NodeArg,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Take no new sandboxes on NODE and hibernate its sandboxes into the shared
    repository: each resumes on another node (through a gateway) the next time it is used.

    Examples:

    ```
    aenv node drain node-a
    ```
    """
    print(f"draining node {node}: hibernating and uploading its sandboxes...", file=sys.stderr)
    with state_of(ctx).control() as cp:
        doc = cp.request(
            "POST",
            f"/nodes/{url_segment(node)}",
            json={"status": "draining"},
            timeout=DRAIN_TIMEOUT,
        ).json()
    if json_out:
        print_json(doc)
        return
    boxes = doc.get("sandboxes") or []
    moved = sum(1 for b in boxes if b.get("published"))
    print(f"node {node} is draining: {moved} of {len(boxes)} sandboxes can move")
    for b in boxes:
        if not b.get("published"):
            print(f"  {b.get('sandboxID')}: stays ({b.get('error') or 'not published'})")


def node_undrain(ctx: typer.Context, node: NodeArg) -> None:
    """Let NODE take new sandboxes again.

    Examples:

    ```
    aenv node undrain node-a
    ```
    """
    with state_of(ctx).control() as cp:
        cp.request("POST", f"/nodes/{url_segment(node)}", json={"status": "ready"})
    print(f"node {node} is ready")
