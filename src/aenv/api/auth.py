"""Control-plane authentication: one API key, sent as `X-API-Key: KEY` or
`Authorization: Bearer KEY`, that is one of the node's named keys (`aenv.keys`) or
AENV_API_KEY.

Applied as a router dependency (not a middleware), so the data plane, `/health` and the
OpenAPI document are not affected. Exactly one credential must be sent: the header twice, or
both headers, get 401 whatever the values, so no proxy or client can smuggle a second key
past a first (AgentENV suite 08_auth). `X-Admin-Token`, `X-Team-ID` and the sandboxes'
envd/traffic tokens authenticate nothing; an `Authorization` header of another scheme is not
ours (a proxy's) and is ignored.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from aenv.config import Settings
from aenv.errors import Unauthorized
from aenv.keys import KeyStore, presented_key


def check_api_key(key: str, store: KeyStore, fixed: str | None) -> str | None:
    """The name of the stored key `key` is (None for `fixed`, AENV_API_KEY); Unauthorized
    when it is neither."""
    # Both checks always run, so timing does not tell a stored key from the fixed one.
    stored = store.verify(key)
    is_fixed = fixed is not None and hmac.compare_digest(key.encode(), fixed.encode())
    if not key or not (stored is not None or is_fixed):
        raise Unauthorized("Invalid API key")
    return stored.name if stored is not None else None


async def require_api_key(request: Request) -> None:
    settings: Settings = request.app.state.settings
    store: KeyStore = request.app.state.api_keys
    # Its quota applies to what the request creates (`key_name`).
    request.state.api_key_name = check_api_key(
        presented_key(request.headers), store, settings.api_key
    )


def key_name(request: Request) -> str | None:
    """The named key that authenticated the request (None: AENV_API_KEY)."""
    name: str | None = getattr(request.state, "api_key_name", None)
    return name
