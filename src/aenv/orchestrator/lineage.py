"""Lineage (docs/fork-tree.md): where a sandbox came from, recorded at create and fork
(`Lineage` on its record, persisted and moved with it), and the tree around one sandbox:
its ancestors, oldest first, and its live descendants.

Only ids are kept: a killed sandbox's record goes as before, so an ancestor that is gone
is shown by the id its child kept, as `killed`, and the walk up stops there (its own
origin went with it). The tree is this node's: a descendant on another node (created there
from a snapshot in the shared repository) is not listed."""

from __future__ import annotations

import builtins
from dataclasses import dataclass, field
from typing import Literal

from ..domain import Lineage, SandboxRecord, TemplateKind, TemplateRecord
from ..errors import NotFound
from .table import SandboxTable

# Bounds on the walks: a record edited by hand into a loop must not hang a request.
_MAX_DEPTH = 1000

Live = Literal["running", "paused"]


def lineage_from(template: TemplateRecord) -> Lineage:
    """The lineage of a sandbox created from `template` (a fork child's is its parent's,
    set by fork.py once the child exists)."""
    if template.kind is TemplateKind.SNAPSHOT and not template.internal:
        return Lineage(
            template_id=template.parent,
            snapshot_id=template.template_id,
            snapshot_of=template.sandbox_id,
        )
    return Lineage(template_id=template.template_id)


def fork_lineage(parent: SandboxRecord, fork_point: str) -> Lineage:
    return Lineage(
        template_id=parent.lineage.template_id or parent.template_id,
        parent_id=parent.sandbox_id,
        fork_point=fork_point,
    )


@dataclass(frozen=True)
class Ancestor:
    sandbox_id: str
    # Killed: gone, nothing but its id is known.
    state: Literal["running", "paused", "killed"]
    lineage: Lineage | None = None


@dataclass
class Descendant:
    sandbox_id: str
    state: Live
    lineage: Lineage
    children: builtins.list[Descendant] = field(default_factory=list)


@dataclass(frozen=True)
class LineageTree:
    sandbox_id: str
    lineage: Lineage
    ancestors: builtins.list[Ancestor]
    descendants: builtins.list[Descendant]


def _live(table: SandboxTable, sandbox_id: str) -> SandboxRecord | None:
    try:
        return table.get(sandbox_id)
    except NotFound:
        return None


def _state(r: SandboxRecord) -> Live:
    return "paused" if r.shown_paused else "running"


def lineage_tree(table: SandboxTable, sandbox_id: str) -> LineageTree:
    """The tree around a live sandbox (NotFound otherwise)."""
    me = table.get(sandbox_id)
    ancestors: list[Ancestor] = []
    seen = {me.sandbox_id}
    up = me.lineage.origin
    while up is not None and up not in seen and len(ancestors) < _MAX_DEPTH:
        seen.add(up)
        r = _live(table, up)
        if r is None:
            ancestors.append(Ancestor(sandbox_id=up, state="killed"))
            break
        ancestors.append(Ancestor(sandbox_id=up, state=_state(r), lineage=r.lineage))
        up = r.lineage.origin
    ancestors.reverse()
    # Children by origin, from one pass over the live sandboxes.
    children: dict[str, list[SandboxRecord]] = {}
    for r in table.list():
        if r.lineage.origin is not None:
            children.setdefault(r.lineage.origin, []).append(r)

    def below(of: str, depth: int) -> list[Descendant]:
        if depth >= _MAX_DEPTH:
            return []
        out = []
        for r in children.get(of, []):
            if r.sandbox_id in seen:
                continue
            seen.add(r.sandbox_id)
            out.append(
                Descendant(r.sandbox_id, _state(r), r.lineage, below(r.sandbox_id, depth + 1))
            )
        return out

    return LineageTree(me.sandbox_id, me.lineage, ancestors, below(me.sandbox_id, 0))
