"""Nodes' answers as the gateway reads and passes them on: a JSON body read leniently (a
node's answer that is not what was expected reads as empty), and an answer passed on as it is
(less the framing headers the gateway's server sets itself)."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response


def json_object(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def json_list(raw: bytes) -> list[dict[str, Any]]:
    try:
        doc = json.loads(raw or b"[]")
    except ValueError:
        return []
    return [d for d in doc if isinstance(d, dict)] if isinstance(doc, list) else []


def plain(resp: Any) -> Response:
    headers = {
        k: v
        for k, v in resp.headers.items()
        if k.lower()
        not in ("content-length", "transfer-encoding", "connection", "content-encoding")
    }
    return Response(resp.content, status_code=resp.status_code, headers=headers)
