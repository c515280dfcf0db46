"""`GET /docs`: the API's reference page (Swagger UI over `/openapi.json`), its script and
styles served by the node itself (the console's pinned packages), so it works offline."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse

from aenv.console import VENDOR_PATH

router = APIRouter(include_in_schema=False)


@router.get("/docs")
async def docs() -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="aenv API",
        swagger_js_url=f"{VENDOR_PATH}/swagger-ui-bundle.js",
        swagger_css_url=f"{VENDOR_PATH}/swagger-ui.css",
        swagger_favicon_url=f"{VENDOR_PATH}/swagger-favicon.png",
    )
