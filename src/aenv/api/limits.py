"""A bound on control-plane request bodies: every JSON body the API takes is small, so a
larger one is refused with a 413 in E2B's JSON shape before it is read into memory. Build
contexts are uploaded to their own route, which streams to disk with its own bound."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response

MAX_JSON_BODY = 1 << 20


class BodyLimit:
    """ASGI middleware: `BodyLimit(app, limit, exempt=lambda path: ...)`."""

    def __init__(
        self, app: ASGIApp, limit: int = MAX_JSON_BODY, exempt: Callable[[str], bool] | None = None
    ) -> None:
        self.app = app
        self.limit = limit
        self.exempt = exempt or (lambda _path: False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.exempt(scope["path"]):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            await self._refuse(scope, receive, send)
            return
        if declared is not None:
            await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): read up to the bound, then hand the body on whole.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message]), send)
                return
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._refuse(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        await self.app(scope, _replay([{"type": "http.request", "body": body}], receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413, f"request body larger than {self.limit} bytes", headers={"connection": "close"}
        )
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(messages: list[Message], then: Receive | None = None) -> Receive:
    queue = list(messages)

    async def receive() -> Message:
        if queue:
            return queue.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive
