"""Serving the console: its static files, the pinned front-end packages (`vendor/`), and
`index.html` for every page path of the single-page app (`/console/sandboxes/ID`...).

Nothing here holds a secret or calls the API: the page is public, the user logs in with an
API key in the browser, and every call the page makes is a public API call carrying it.
The front-end packages (xterm.js) come from `node_modules/` next to this file, installed by
`make install` (`npm ci` of package-lock.json); without them the console still serves and
its terminal tells the user to run `make install`."""

from __future__ import annotations

import html
from pathlib import Path, PurePosixPath

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route

CONSOLE_PATH = "/console"
HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"
VENDOR_DIR = HERE / "node_modules"
# `vendor/NAME` -> the file in node_modules: an allow-list, so nothing else there is served.
VENDOR_FILES: dict[str, str] = {
    "xterm.mjs": "@xterm/xterm/lib/xterm.mjs",
    "xterm.css": "@xterm/xterm/css/xterm.css",
    "addon-fit.mjs": "@xterm/addon-fit/lib/addon-fit.mjs",
    # The API's reference page (`/docs`), served from here rather than a CDN: offline too.
    "swagger-ui-bundle.js": "swagger-ui-dist/swagger-ui-bundle.js",
    "swagger-ui.css": "swagger-ui-dist/swagger-ui.css",
    "swagger-favicon.png": "swagger-ui-dist/favicon-32x32.png",
}
# Where the console serves them.
VENDOR_PATH = f"{CONSOLE_PATH}/vendor"
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".json": "application/json",
}
# Scripts only from the console itself (no inline script, no CDN: it works offline); the
# terminal's renderer sets inline styles; API and envd calls go to the same origin.
_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; "
        "base-uri 'self'; form-action 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def wants_html(request: Request) -> bool:
    """A browser navigating (its Accept names HTML); API clients and SDKs do not."""
    return "text/html" in request.headers.get("accept", "")


def _not_found(message: str) -> JSONResponse:
    return JSONResponse({"code": 404, "message": message}, 404, headers=_SECURITY_HEADERS)


def _file(path: Path) -> Response:
    media = _TYPES.get(path.suffix, "application/octet-stream")
    return FileResponse(path, media_type=media, headers=_SECURITY_HEADERS)


def _static(relative: str, root: Path) -> Path | None:
    """The file `relative` names below `root`, or None (missing, a directory, or a path
    that would leave `root`)."""
    parts = PurePosixPath(relative).parts
    if not parts or any(p in ("..", ".") or p.startswith("/") for p in parts):
        return None
    candidate = root.joinpath(*parts).resolve()
    if not candidate.is_relative_to(root) or not candidate.is_file():
        return None
    return candidate


class Console:
    """The console's ASGI endpoints, over a static directory and a vendor directory (both
    may be given for tests)."""

    def __init__(
        self, static_dir: Path = STATIC_DIR, vendor_dir: Path = VENDOR_DIR, mount: str = ""
    ) -> None:
        self.static_dir = static_dir.resolve()
        self.vendor_dir = vendor_dir
        self.mount = mount
        self._index = (self.static_dir / "index.html").read_text(encoding="utf-8")

    def vendor_missing(self) -> list[str]:
        return [n for n, rel in VENDOR_FILES.items() if not (self.vendor_dir / rel).is_file()]

    async def page(self, request: Request) -> Response:
        relative = request.path_params.get("path", "")
        if relative.startswith("vendor/"):
            return self._vendor(relative[len("vendor/") :])
        found = _static(relative, self.static_dir) if relative else None
        if found is not None:
            return _file(found)
        if "." in PurePosixPath(relative).name:
            return _not_found(f"no console file {relative!r}")
        return self._index_page(request)

    def _vendor(self, name: str) -> Response:
        rel = VENDOR_FILES.get(name)
        if rel is None:
            return _not_found(f"no vendor file {name!r}")
        path = self.vendor_dir / rel
        if not path.is_file():
            return _not_found(
                f"the console's front-end packages are not installed ({rel} missing): "
                "run `make install`"
            )
        return _file(path)

    def _index_page(self, request: Request) -> Response:
        """index.html for a page path; its `<base>` is where the console is mounted, and
        the API's root (the same server, or a prefix a reverse proxy adds) in a meta tag."""
        root = str(request.scope.get("root_path", "")).rstrip("/")
        api = root[: -len(self.mount)] if self.mount and root.endswith(self.mount) else ""
        body = self._index.replace("{{BASE}}", html.escape(root + "/")).replace(
            "{{API}}", html.escape(api)
        )
        return Response(body, media_type=_TYPES[".html"], headers=_SECURITY_HEADERS)


def console_app(
    static_dir: Path = STATIC_DIR, vendor_dir: Path = VENDOR_DIR, mount: str = CONSOLE_PATH
) -> Starlette:
    """The console as an ASGI app to mount at `mount`."""
    console = Console(static_dir, vendor_dir, mount)
    app = Starlette(routes=[Route("/{path:path}", console.page, methods=["GET", "HEAD"])])
    app.state.console = console
    return app


async def _to_console(request: Request) -> Response:
    root = str(request.scope.get("root_path", "")).rstrip("/")
    return RedirectResponse(f"{root}{CONSOLE_PATH}/", status_code=302)


def browser_redirect(request: Request) -> Response | None:
    """A browser's `GET /` goes to the console; anything else: None (the caller answers)."""
    if request.method in ("GET", "HEAD") and wants_html(request):
        return RedirectResponse(f"{CONSOLE_PATH}/", status_code=302)
    return None


def console_routes(app: Starlette | None = None) -> list[BaseRoute]:
    """`/console` (redirected to `/console/`) and the console mounted at `/console/`."""
    return [
        Route(CONSOLE_PATH, _to_console, methods=["GET", "HEAD"], include_in_schema=False),
        Mount(CONSOLE_PATH, app=app or console_app()),
    ]


def install_console(app: Starlette) -> None:
    """Adds the console to the node's control app, and `/` for browsers: a browser's
    `GET /` is sent to the console, every other request for `/` is the 404 it was."""

    async def root(request: Request) -> Response:
        redirect = browser_redirect(request)
        if redirect is None:
            raise HTTPException(404)
        return redirect

    app.router.routes.extend(console_routes())
    app.add_route("/", root, methods=_ALL_METHODS, include_in_schema=False)
