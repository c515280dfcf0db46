"""What gateways ask a node besides the E2B API: drain (E2B's `POST /nodes/{nodeID}` with a
status), moving a hibernated sandbox between nodes (release here, adopt there), and which
sandbox of this node signed a file URL (a signed URL made against the gateway's address names
no sandbox, and only the node holds the envd tokens that sign)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from aenv.errors import NotFound

from ..auth import require_api_key
from ..deps import OrchestratorDep
from ..models import LIFECYCLE_ERRORS

router = APIRouter(
    tags=["cluster"], dependencies=[Depends(require_api_key)], responses=LIFECYCLE_ERRORS
)


class NodeStatusChange(BaseModel):
    status: Literal["ready", "draining"]
    cluster_id: str | None = Field(default=None, alias="clusterID")


class DrainedSandbox(BaseModel):
    sandboxID: str
    published: bool
    error: str | None = None


class NodeStatusResult(BaseModel):
    nodeID: str
    status: str
    sandboxes: list[DrainedSandbox] = Field(default_factory=list)


class Released(BaseModel):
    sandboxID: str
    image: str


class AdoptRequest(BaseModel):
    image: str = Field(min_length=1, max_length=200)


class Adopted(BaseModel):
    sandboxID: str
    state: str


class SignedQuery(BaseModel):
    """A signed file URL's parts, as envd checks them."""

    path: str = Field(max_length=4096)
    operation: Literal["read", "write"]
    username: str = Field(default="", max_length=256)
    signature: str = Field(min_length=1, max_length=256)
    expiration: str | None = Field(default=None, max_length=32)


class Signer(BaseModel):
    sandboxID: str


@router.post("/nodes/{node_id}", summary="Drain a node, or make it take sandboxes again")
async def set_node_status(
    node_id: str, change: NodeStatusChange, orchestrator: OrchestratorDep
) -> NodeStatusResult:
    own = orchestrator.settings.cluster_node_id
    if node_id != own:
        raise NotFound(f"node {node_id!r} not found (this is node {own!r})")
    if change.status == "ready":
        orchestrator.mover.undrain()
        return NodeStatusResult(nodeID=own, status="ready")
    done = await orchestrator.mover.drain()
    return NodeStatusResult(
        nodeID=own,
        status="draining",
        sandboxes=[
            DrainedSandbox(sandboxID=d.sandbox_id, published=d.published, error=d.error)
            for d in done
        ],
    )


@router.post("/cluster/sandboxes/{sandbox_id}/release", summary="Give a sandbox up")
async def release(sandbox_id: str, orchestrator: OrchestratorDep) -> Released:
    return Released(sandboxID=sandbox_id, image=await orchestrator.mover.release(sandbox_id))


@router.post("/cluster/sandboxes/{sandbox_id}/adopt", summary="Take a sandbox over")
async def adopt(sandbox_id: str, req: AdoptRequest, orchestrator: OrchestratorDep) -> Adopted:
    r = await orchestrator.mover.adopt(sandbox_id, req.image)
    return Adopted(sandboxID=r.sandbox_id, state=r.state.value)


@router.post("/cluster/signed", summary="The sandbox of this node that signed a file URL")
async def signed(q: SignedQuery, orchestrator: OrchestratorDep) -> Signer:
    found = await orchestrator.signed_by(q.path, q.operation, q.username, q.signature, q.expiration)
    if found is None:
        raise NotFound("no sandbox of this node signed it")
    return Signer(sandboxID=found)
