"""Every API answer carries an `X-Request-Id`: the client's own when it sent a usable one
(so a caller can follow its request through the node's logs), else a new one. Log lines
written while the request is handled carry it too (`logctx.request_id_var`), and with
`AENV_ACCESS_LOG` each request gets one line: method, path, status, milliseconds.

A gateway wraps its control plane in this too: the id it settles on is put in the request's
own headers, so the node the request goes on to logs and answers the same id."""

from __future__ import annotations

import logging
import re
import secrets
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aenv.logctx import request_id_var

HEADER = "x-request-id"
_USABLE = re.compile(r"[A-Za-z0-9._:-]{1,128}")

log = logging.getLogger("aenv.access")


class RequestId:
    def __init__(self, app: ASGIApp, *, access_log: bool = False) -> None:
        self.app = app
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _given(scope) or secrets.token_hex(8)
        # In place, as Starlette's router does: what is inside (a forward) sees it.
        scope["headers"] = [
            *((k, v) for k, v in scope.get("headers", []) if k != HEADER.encode()),
            (HEADER.encode(), rid.encode()),
        ]
        token = request_id_var.set(rid)
        start = time.monotonic()
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [(k, v) for k, v in message.get("headers", []) if k != HEADER.encode()]
                message = {**message, "headers": [*headers, (HEADER.encode(), rid.encode())]}
            await send(message)

        # Behind this wrapper the proxy still finds the server's `send` (reset_client).
        send_with_id.__wrapped__ = send  # type: ignore[attr-defined]
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.access_log:
                ms = (time.monotonic() - start) * 1000
                log.info(
                    "%s %s %s %.1f ms",
                    scope["method"],
                    scope["path"],
                    status,
                    ms,
                    extra={"request_id": rid},
                )
            request_id_var.reset(token)


def _given(scope: Scope) -> str | None:
    for key, value in scope.get("headers", []):
        if key == HEADER.encode():
            text = value.decode("latin-1")
            return text if _USABLE.fullmatch(text) else None
    return None
