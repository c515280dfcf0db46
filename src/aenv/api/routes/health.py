"""`GET /health`: liveness, without authentication (AgentENV suites 01 and 08)."""

from __future__ import annotations

from fastapi import APIRouter, Response

router = APIRouter(tags=["health"])


@router.get("/health", status_code=204, response_class=Response, summary="Liveness")
async def health() -> Response:
    return Response(status_code=204)
