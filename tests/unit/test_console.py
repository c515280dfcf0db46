"""The web console's routes: static files, index.html for page paths (SPA fallback), the
pinned front-end packages under vendor/ (present or not), and where the node and the
gateway mount it (a browser's `GET /` goes there; API clients see the JSON 404 as before)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.types import ASGIApp

from aenv.config import Settings
from aenv.console import STATIC_DIR, VENDOR_DIR, VENDOR_FILES, console_app
from aenv.console.app import Console
from aenv.server import gateway_app
from tests.node_harness import started
from tests.unit.api_node import api_client

API_KEY = "e2b_console_unit_key"
HTML = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}


def _client(app: ASGIApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The node's app (a real orchestrator on the fake runtime), no key sent."""
    async for h in started(tmp_path, api_key=API_KEY):
        async with api_client(h, key=None) as c:
            yield c


def _vendor_tree(root: Path) -> Path:
    for name, rel in VENDOR_FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"/* {name} */ export const X = 1;\n")
    return root


async def test_index_and_page_paths_serve_the_app(node: httpx.AsyncClient) -> None:
    """No key needed for the page itself (it holds no secret); every page path of the
    single-page app is index.html, with its <base> at the mount."""
    for path in (
        "/console/",
        "/console/sandboxes",
        "/console/sandboxes/abc123",
        "/console/nodes/n1",
    ):
        r = await node.get(path)
        assert r.status_code == 200, path
        assert r.headers["content-type"].startswith("text/html")
        assert '<base href="/console/">' in r.text
        assert '<meta name="aenv-api" content="">' in r.text
        assert 'src="js/main.js"' in r.text
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "connect-src 'self'" in csp
        assert "{{" not in r.text


async def test_static_files_with_their_types(node: httpx.AsyncClient) -> None:
    r = await node.get("/console/js/main.js")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/javascript")
    assert r.text == (STATIC_DIR / "js" / "main.js").read_text()
    r = await node.get("/console/app.css")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/css")
    r = await node.get("/console/favicon.svg")
    assert r.status_code == 200 and r.headers["content-type"] == "image/svg+xml"
    assert r.headers["cache-control"] == "no-cache"


async def test_every_module_the_app_imports_is_served(node: httpx.AsyncClient) -> None:
    """The ES modules import each other by relative paths: all of them resolve."""
    pending, seen = ["js/main.js"], set()
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        r = await node.get(f"/console/{path}")
        assert r.status_code == 200, path
        base = path.rsplit("/", 1)[0]
        for rel in re.findall(r'from "(\.[^"]+)"', r.text):
            parts = f"{base}/{rel}".split("/")
            out: list[str] = []
            for part in parts:
                if part == "..":
                    out.pop()
                elif part != ".":
                    out.append(part)
            pending.append("/".join(out))
    assert {"js/pty.js", "js/terminal.js", "js/pages/sandbox.js"} <= seen


async def test_missing_files_and_escapes_are_404(node: httpx.AsyncClient) -> None:
    for path in ("/console/nope.js", "/console/js/nope.js", "/console/static/index.html"):
        r = await node.get(path)
        assert r.status_code == 404, path
        assert r.json()["code"] == 404
    # Encoded dots do not leave the static directory (app.py is one level up).
    for raw in (
        "/console/%2e%2e/app.py",
        "/console/js/%2e%2e/%2e%2e/app.py",
        "/console/..%2fapp.py",
    ):
        r = await node.get(raw)
        assert r.status_code == 404, raw
        assert "def console_app" not in r.text


async def test_vendor_files_when_installed(tmp_path: Path) -> None:
    app = console_app(vendor_dir=_vendor_tree(tmp_path / "node_modules"), mount="")
    async with _client(app) as c:
        for name in VENDOR_FILES:
            r = await c.get(f"/vendor/{name}")
            assert r.status_code == 200, name
            assert name in r.text
        assert (
            (await c.get("/vendor/xterm.mjs")).headers["content-type"].startswith("text/javascript")
        )
        assert (await c.get("/vendor/xterm.css")).headers["content-type"].startswith("text/css")
        # Only the allow-listed files: nothing else in node_modules is served.
        r = await c.get("/vendor/@xterm/xterm/package.json")
        assert r.status_code == 404


async def test_vendor_files_missing_say_make_install(tmp_path: Path) -> None:
    """Without the packages the console still serves; the terminal's modules are a 404 that
    tells what to do."""
    app = console_app(vendor_dir=tmp_path / "absent", mount="")
    assert app.state.console.vendor_missing() == list(VENDOR_FILES)
    async with _client(app) as c:
        r = await c.get("/vendor/xterm.mjs")
        assert r.status_code == 404
        assert "make install" in r.json()["message"]
        assert (await c.get("/")).status_code == 200


def test_installed_vendor_files_match_the_lock() -> None:
    """`make install` ran (the test extra needs it): the pinned versions are what is served."""
    import json

    lock = json.loads((STATIC_DIR.parent / "package-lock.json").read_text())
    if not VENDOR_DIR.exists():
        pytest.skip("front-end packages not installed (make install)")
    assert not Console().vendor_missing()
    for package in ("@xterm/xterm", "@xterm/addon-fit", "swagger-ui-dist"):
        installed = json.loads((VENDOR_DIR / package / "package.json").read_text())["version"]
        assert installed == lock["packages"][f"node_modules/{package}"]["version"]


async def test_the_api_reference_loads_nothing_from_outside(node: httpx.AsyncClient) -> None:
    """`/docs` (no key, like the page): Swagger UI whose script, styles and icon are the
    node's own pinned files, so it is not blank offline."""
    page = await node.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    refs = re.findall(r"""(?:src|href)=["']([^"']+)|url: ?['"]([^'"]+)""", page.text)
    urls = [u for pair in refs for u in pair if u]
    assert "/openapi.json" in urls and len(urls) >= 4, urls
    assert not [u for u in urls if "://" in u or u.startswith("//")], urls
    if not VENDOR_DIR.exists():
        pytest.skip("front-end packages not installed (make install)")
    for url in urls:
        r = await node.get(url)
        assert r.status_code == 200, url
        assert r.content, url


async def test_root_redirects_browsers_only(node: httpx.AsyncClient) -> None:
    r = await node.get("/", headers=HTML)
    assert r.status_code == 302 and r.headers["location"] == "/console/"
    r = await node.get("/console", headers=HTML)
    assert r.status_code == 302 and r.headers["location"] == "/console/"
    # API clients (the SDKs never ask for /): the same JSON 404 as any unknown route.
    for method, headers in (("GET", {}), ("GET", {"Accept": "application/json"}), ("POST", HTML)):
        r = await node.request(method, "/", headers=headers)
        assert r.status_code == 404
        assert r.json() == {"code": 404, "message": f"no route for {method} /"}


async def test_console_is_not_in_the_api_document(node: httpx.AsyncClient) -> None:
    paths = (await node.get("/openapi.json")).json()["paths"]
    assert not [p for p in paths if p == "/" or p.startswith("/console")]


async def test_api_calls_still_need_the_key(node: httpx.AsyncClient) -> None:
    assert (await node.get("/v2/sandboxes")).status_code == 401
    r = await node.get("/v2/sandboxes", headers={"X-API-Key": API_KEY})
    assert r.status_code == 200


async def test_gateway_serves_the_console(tmp_path: Path) -> None:

    # Redis is only reached by API requests; the console's never touch it.
    app = gateway_app(Settings(home=tmp_path, redis_url="redis://127.0.0.1:9/0"))
    async with _client(app) as c:
        r = await c.get("/console/sandboxes/abc")
        assert r.status_code == 200 and '<base href="/console/">' in r.text
        assert (await c.get("/console/js/pty.js")).status_code == 200
        r = await c.get("/", headers=HTML)
        assert r.status_code == 302 and r.headers["location"] == "/console/"
        assert (await c.get("/console", headers=HTML)).status_code == 302


def test_scripts_parse_as_es_modules() -> None:
    """Every script of the console is valid JavaScript (no build step catches a typo)."""
    import shutil
    import subprocess

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (make install)")
    scripts = sorted((STATIC_DIR / "js").rglob("*.js"))
    assert scripts
    for script in scripts:
        r = subprocess.run(
            [node, "--experimental-default-type=module", "--check", str(script)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, f"{script.name}: {r.stderr}"
