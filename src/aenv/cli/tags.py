"""`aenv template tags ls|add|rm`: a template's tags, each pointing at one of its builds
(E2B's `Template.get_tags`, `assign_tags`, `remove_tags`)."""

from __future__ import annotations

from typing import Annotated

import typer

from .client import url_segment
from .options import AutoOutputOpt, QuietOpt
from .output import (
    Column,
    Listing,
    OutputFormat,
    local_time,
    print_json,
    print_listing,
    resolve_format,
)
from .state import state_of

TagsArg = Annotated[list[str], typer.Argument(metavar="TAG...", help="Tags.")]


def tags_ls(
    ctx: typer.Context,
    template: Annotated[str, typer.Argument(metavar="TEMPLATE", help="Template ID or name.")],
    output: AutoOutputOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """List a template's tags and the build each one points at.

    Examples:

    ```
    aenv template tags ls my-app
    aenv template tags ls my-app -o yaml
    aenv template tags ls my-app -q
    ```
    """
    with state_of(ctx).control() as cp:
        items = cp.request("GET", f"/templates/{url_segment(template)}/tags").json()
    print_listing(items, TAGS, resolve_format(output, piped=OutputFormat.json), quiet)


TAGS = Listing(
    columns=(
        Column("TAG", lambda t: t.get("tag")),
        Column("BUILD", lambda t: t.get("buildID")),
        Column("ASSIGNED", lambda t: local_time(t.get("createdAt"))),
    ),
    id_of=lambda t: t.get("tag"),
    empty="no tags",
)


def tags_add(
    ctx: typer.Context,
    target: Annotated[
        str,
        typer.Argument(
            metavar="NAME[:TAG]",
            help="The build to tag: NAME (its default build) or NAME:TAG (the build TAG is on).",
        ),
    ],
    tags: TagsArg,
    json_out: Annotated[bool, typer.Option("--json", help="Print the server's answer.")] = False,
) -> None:
    """Point tags at a template's build (moving them from wherever they were).

    Examples:

    ```
    aenv template tags add my-app v1 stable       # the default build gets v1 and stable
    aenv template tags add my-app:v1 prod         # prod moves to the build v1 is on
    ```
    """
    with state_of(ctx).control() as cp:
        data = cp.request(
            "POST", "/templates/tags", json={"target": target, "tags": tags}, ok=(201, 200)
        ).json()
    if json_out:
        print_json(data)
    else:
        print(f"{target}: build {data.get('buildID')} tagged {', '.join(data.get('tags') or [])}")


def tags_rm(
    ctx: typer.Context,
    template: Annotated[str, typer.Argument(metavar="NAME", help="Template name or ID.")],
    tags: TagsArg,
) -> None:
    """Remove tags from a template (a build no tag points at any more is dropped).

    Examples:

    ```
    aenv template tags rm my-app v1
    ```
    """
    with state_of(ctx).control() as cp:
        cp.request(
            "DELETE", "/templates/tags", json={"name": template, "tags": tags}, ok=(204, 200)
        )
    print(f"{template}: removed {', '.join(tags)}")
