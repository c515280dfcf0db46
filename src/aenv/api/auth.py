"""Control-plane authentication: exactly one `X-API-Key` header equal to the node's key.

Applied as a router dependency (not a middleware), so the data plane, `/health` and the
OpenAPI document are not affected. Nothing else authenticates: `Authorization: Bearer`,
`X-Admin-Token`, `X-Team-ID` and the sandboxes' envd/traffic tokens all get 401, and so does a
request carrying the header twice, whatever the values (AgentENV suite 08_auth).
"""

from __future__ import annotations

import hmac

from fastapi import Request

from aenv.config import Settings
from aenv.errors import Unauthorized

API_KEY_HEADER = "x-api-key"


def check_api_key(values: list[str], expected: str) -> None:
    """Raises Unauthorized unless `values` (every X-API-Key header sent) is exactly [expected]."""
    if not values:
        raise Unauthorized("missing X-API-Key header")
    if len(values) > 1:
        raise Unauthorized("X-API-Key header sent more than once")
    if not hmac.compare_digest(values[0].strip().encode(), expected.encode()):
        raise Unauthorized("invalid API key")


async def require_api_key(request: Request) -> None:
    settings: Settings = request.app.state.settings
    check_api_key(request.headers.getlist(API_KEY_HEADER), settings.effective_api_key)
