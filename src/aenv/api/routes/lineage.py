"""`GET /sandboxes/{id}/lineage` (aenv's, docs/fork-tree.md): a sandbox's ancestors, oldest
first, and its live descendants as a tree."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from aenv.orchestrator import Descendant, lineage_tree

from ..auth import require_api_key
from ..deps import OrchestratorDep
from ..models import LIFECYCLE_ERRORS
from ..tree_models import LineageAncestor, LineageDescendant, LineageInfo, LineageTreeInfo

router = APIRouter(
    tags=["sandboxes"], dependencies=[Depends(require_api_key)], responses=LIFECYCLE_ERRORS
)


def _descendant(d: Descendant) -> LineageDescendant:
    return LineageDescendant(
        sandboxID=d.sandbox_id,
        state=d.state,
        lineage=LineageInfo.of(d.lineage),
        children=[_descendant(c) for c in d.children],
    )


@router.get("/sandboxes/{sandbox_id}/lineage", summary="A sandbox's ancestors and descendants")
async def get_lineage(sandbox_id: str, orchestrator: OrchestratorDep) -> LineageTreeInfo:
    tree = lineage_tree(orchestrator.table, sandbox_id)
    return LineageTreeInfo(
        sandboxID=tree.sandbox_id,
        lineage=LineageInfo.of(tree.lineage),
        ancestors=[
            LineageAncestor(
                sandboxID=a.sandbox_id,
                state="killed"
                if a.state == "killed"
                else "paused"
                if a.state == "paused"
                else "running",
                lineage=None if a.lineage is None else LineageInfo.of(a.lineage),
            )
            for a in tree.ancestors
        ],
        descendants=[_descendant(d) for d in tree.descendants],
    )
