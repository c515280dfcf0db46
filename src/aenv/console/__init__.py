"""The web console: a static single-page app served at `/console/` by the node and by the
gateway, built only on the public HTTP API (the browser calls it with the user's key).

`console_app()` is the ASGI app to mount at `/console`; `browser_redirect` sends a browser's
`GET /` there (API clients never ask for `/`, and one that does without `Accept: text/html`
still gets the API's JSON 404)."""

from __future__ import annotations

from .app import (
    CONSOLE_PATH,
    STATIC_DIR,
    VENDOR_DIR,
    VENDOR_FILES,
    VENDOR_PATH,
    browser_redirect,
    console_app,
    console_routes,
    install_console,
    wants_html,
)

__all__ = [
    "CONSOLE_PATH",
    "STATIC_DIR",
    "VENDOR_DIR",
    "VENDOR_FILES",
    "VENDOR_PATH",
    "browser_redirect",
    "console_app",
    "console_routes",
    "install_console",
    "wants_html",
]
