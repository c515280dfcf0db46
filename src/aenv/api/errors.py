"""The one place where errors become HTTP responses: E2B's `{code, message[, error_code]}` JSON.

Routes and services raise `aenv.errors.AenvError` subclasses; FastAPI's request validation,
Starlette's routing errors (404/405) and unexpected exceptions are turned into the same shape,
because the SDK's generated client parses every enumerated error status as that JSON.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aenv.errors import AenvError

log = logging.getLogger(__name__)


def error_response(
    status: int,
    message: str,
    *,
    error_code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body: dict[str, object] = {"code": status, "message": message}
    if error_code:
        body["error_code"] = error_code
    return JSONResponse(body, status_code=status, headers=dict(headers) if headers else None)


def _loc(loc: Sequence[Any]) -> str:
    # ("body", "timeout") -> "timeout"; ("query", "limit") -> "limit"; ("body",) -> "body".
    parts = [str(p) for p in loc]
    if len(parts) > 1 and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    return ".".join(parts)


def validation_summary(errors: Sequence[Any]) -> str:
    """One readable line for a list of pydantic/FastAPI validation errors."""
    parts: list[str] = []
    for err in errors:
        kind = err.get("type", "")
        loc = _loc(err.get("loc", ()))
        if kind == "json_invalid":
            parts.append("request body is not valid JSON")
        elif kind == "missing" and loc == "body":
            parts.append("request body is required")
        elif loc == "body" and isinstance(err.get("input"), bytes):
            # FastAPI hands over raw bytes when the Content-Type is not JSON.
            parts.append("request body must be JSON (Content-Type: application/json)")
        elif loc:
            parts.append(f"{loc}: {err.get('msg', 'invalid value')}")
        else:
            parts.append(str(err.get("msg", "invalid request")))
    return "; ".join(parts) or "invalid request"


async def _aenv_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, AenvError)
    if exc.status >= 500:
        log.error("%s %s failed: %s", request.method, request.url.path, exc.message)
    return JSONResponse(exc.to_json(), status_code=exc.status, headers=exc.headers())


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(400, validation_summary(exc.errors()))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404 and exc.detail == "Not Found":
        message = f"no route for {request.method} {request.url.path}"
    else:
        message = str(exc.detail)
    return error_response(exc.status_code, message, headers=exc.headers)


class CatchAllMiddleware:
    """Turns an unexpected exception into a logged 500 `{code, message}` response.

    Unlike an exception handler for `Exception` (Starlette re-raises after answering), the
    exception stops here, so the server logs it once and wrappers around this app never see
    it. If the response had already started, there is nothing to answer: re-raise."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            response = error_response(500, f"internal error: {type(exc).__name__}: {exc}")
            await response(scope, receive, send)


def _optional_parameter(schema: dict[str, Any]) -> dict[str, Any]:
    """`anyOf: [X, null]` -> X: a query parameter or header is absent or a string, never
    JSON null, so the document must not offer null as a value to send."""
    options = schema.get("anyOf")
    if not isinstance(options, list):
        return schema
    rest = [o for o in options if o != {"type": "null"}]
    if len(rest) == len(options):
        return schema
    out = {k: v for k, v in schema.items() if k != "anyOf"}
    if len(rest) == 1:
        out.update(rest[0])
    else:
        out["anyOf"] = rest
    return out


def _truthful_openapi(app: FastAPI) -> None:
    """The OpenAPI document as the API behaves: validation errors are 400 here (not
    FastAPI's 422), any body may be refused as too large (413), optional parameters are
    absent rather than null."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    responses = operation.get("responses", {})
                    responses.pop("422", None)
                    if "requestBody" in operation and "413" not in responses:
                        responses["413"] = {
                            "description": "Request body too large",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/ErrorBody"}
                                }
                            },
                        }
                    for param in operation.get("parameters", []):
                        if "schema" in param:
                            param["schema"] = _optional_parameter(param["schema"])
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def install_error_handlers(app: FastAPI) -> None:
    _truthful_openapi(app)
    app.add_exception_handler(AenvError, _aenv_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(CatchAllMiddleware)
