"""`aenv node ls|drain|undrain`: the nodes behind a gateway (or the one node itself)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Annotated, Any

import typer

from .client import url_segment
from .options import JsonFlagOpt, ListOutputOpt, QuietOpt, WatchOpt
from .output import Column, Listing, print_json, resolve_format
from .state import state_of
from .watch import show_listing

NodeArg = Annotated[str, typer.Argument(metavar="NODE", help="Node ID.")]
# A drain hibernates and uploads every sandbox of the node.
DRAIN_TIMEOUT = 3600.0


def node_ls(
    ctx: typer.Context,
    output: ListOutputOpt = None,
    quiet: QuietOpt = False,
    watch: WatchOpt = False,
    json_out: JsonFlagOpt = False,
) -> None:
    """List the nodes and their status, sandboxes and free memory (`-w`: follow a drain).

    Examples:

    ```
    aenv node ls
    aenv node ls --url http://gateway:8080 -o wide
    aenv node ls -w
    ```
    """
    fmt = resolve_format(output, json_flag=json_out)
    with state_of(ctx).control() as cp:
        show_listing(lambda: cp.request("GET", "/nodes").json(), NODES, fmt, quiet, watch)


def _free(n: Mapping[str, Any]) -> str:
    free = n.get("freeMemoryMB")
    return "" if free is None else f"{free} MiB"


NODES = Listing(
    columns=(
        Column("NODE", lambda n: n.get("nodeID"), key=True),
        Column("STATUS", lambda n: n.get("status")),
        Column("SANDBOXES", lambda n: n.get("sandboxCount", ""), justify="right"),
        Column("FREE MEMORY", _free, justify="right"),
        Column("CPU", lambda n: n.get("cpuCount"), wide=True, justify="right"),
        Column("VERSION", lambda n: n.get("version"), wide=True),
        Column("URL", lambda n: n.get("url", "")),
    ),
    id_of=lambda n: n.get("nodeID"),
    empty="no nodes",
    boxed=True,
)


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
