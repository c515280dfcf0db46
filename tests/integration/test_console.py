"""The web console in headless Chromium (Debian's /usr/bin/chromium, driven by playwright)
against a real node with real gVisor sandboxes: log in with a key (a wrong one refused),
sandboxes appearing in the list, a sandbox's page with a terminal over its PTY (a command
typed and its output rendered), pause and resume (the terminal comes back), snapshot and
the templates, snapshots and nodes pages.

With AENV_CONSOLE_SCREENSHOTS=1 the main pages are written to docs/console-*.png (1280x800).

The node is this module's own (its own network prefix and range) rather than the session's:
a console run never shares host networking with another session on the same machine."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aenv.console.app import Console
from tests import netplan
from tests.helpers import ROOT, RedisServer, free_port, redis_server, wait_healthy
from tests.integration.conftest import AENV, Server, running_server
from tests.integration.test_cli import aenv

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
# playwright adds its own --headless; another one here makes this Chromium hang.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
SHOTS = os.environ.get("AENV_CONSOLE_SCREENSHOTS") == "1"
DOCS = ROOT / "docs"
TIMEOUT_MS = 60_000


def _needs() -> None:
    pytest.importorskip(
        "playwright.sync_api", reason="playwright is a test dependency (make install)"
    )
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} missing: Debian's chromium (make install)")
    if Console().vendor_missing():
        pytest.skip("the console's front-end packages are not installed (make install)")


NODE_ID = f"{netplan.name('con')}-node"  # this test session's


@pytest.fixture(scope="module")
def cluster_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    _needs()
    with redis_server(tmp_path_factory.mktemp("console-redis")) as redis:
        yield redis


@pytest.fixture(scope="module")
def node(cluster_redis: RedisServer) -> Iterator[Server]:
    """A node in a cluster of one (so a gateway can stand in front of it)."""
    with running_server(
        *netplan.slot_net("con").astuple(),
        AENV_HIBERNATE_AFTER="5",
        AENV_REDIS_URL=cluster_redis.url,
        AENV_NODE_ID=NODE_ID,
        AENV_HEARTBEAT_SECONDS="1",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def gateway(node: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`aenv gateway` in front of the node: the console is served there too."""
    url = f"http://127.0.0.1:{free_port()}"
    env = {**node.env, "AENV_LISTEN": url.removeprefix("http://")}
    log_path = tmp_path_factory.mktemp("console-gateway") / "gateway.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [AENV, "gateway"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
        )
    try:
        wait_healthy(url, 60, proc=proc, status=200, log=log_path)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


@pytest.fixture(scope="module")
def made(node: Server) -> Iterator[list[str]]:
    """Sandbox ids (and `snapshot:ID`) the tests create, removed by id at the end."""
    ids: list[str] = []
    yield ids
    with node.client() as c:
        for item in reversed(ids):
            with contextlib.suppress(Exception):
                if item.startswith("snapshot:"):
                    c.delete(f"/templates/{item.split(':', 1)[1]}")
                else:
                    c.delete(f"/sandboxes/{item}")


@pytest.fixture(scope="module")
def page(node: Server) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="aenv-console-chromium-")
    try:
        with sync_playwright() as p:
            context = p.chromium.launch_persistent_context(
                profile,
                executable_path=CHROMIUM,
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1280, "height": 800},
            )
            pg = context.pages[0] if context.pages else context.new_page()
            pg.set_default_timeout(TIMEOUT_MS)
            errors: list[str] = []
            pg.on("pageerror", lambda e: errors.append(str(e)))
            try:
                yield pg
            finally:
                assert not errors, f"JavaScript errors in the console: {errors}"
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def _create(node: Server, made: list[str], **body: Any) -> str:
    with node.client() as c:
        r = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600, **body})
        assert r.status_code == 201, r.text
        sandbox_id = str(r.json()["sandboxID"])
    made.append(sandbox_id)
    return sandbox_id


def _terminal_shows(page: Any, text: str, timeout: int = TIMEOUT_MS) -> None:
    page.wait_for_function(
        "(t) => window.aenvTerminal && window.aenvTerminal.text().includes(t)",
        arg=text,
        timeout=timeout,
    )


def _shot(page: Any, name: str) -> None:
    if SHOTS:
        page.evaluate(
            "() => { document.querySelectorAll('.toast').forEach((t) => t.remove());"
            " window.scrollTo(0, 0); }"
        )
        # Gauges and fresh rows finish their transitions (finite ones: a spinner never ends).
        page.evaluate(
            "() => Promise.all(document.getAnimations()"
            ".filter((a) => a.effect && a.effect.getComputedTiming().endTime !== Infinity)"
            ".map((a) => a.finished.catch(() => null)))"
        )
        page.screenshot(path=str(DOCS / f"console-{name}.png"))


def _state(page: Any, state: str) -> None:
    page.wait_for_selector(f"#sandbox-state .badge[data-state='{state}']")


def test_login_refuses_a_wrong_key_then_logs_in(node: Server, page: Any) -> None:
    page.goto(f"{node.url}/")  # a browser at the root lands in the console
    assert page.url.endswith("/console/")
    page.fill("#api-key", "e2b_not_a_key")
    page.click("#login")
    page.wait_for_selector("#login-error:not(:empty)")
    assert "Wrong API key" in page.inner_text("#login-error")
    assert page.locator("#sandboxes").count() == 0
    page.fill("#api-key", "")
    _shot(page, "login")
    page.fill("#api-key", node.api_key)
    page.click("#login")
    page.wait_for_selector("#sandboxes")
    page.wait_for_selector("#list-status:has-text('updated')")


def test_a_sandbox_appears_with_its_usage(node: Server, made: list[str], page: Any) -> None:
    first = _create(node, made, metadata={"purpose": "console-test"})
    row = f"tr[data-sandbox-id='{first}']"
    page.wait_for_selector(row)
    assert "base" in page.inner_text(row)
    assert page.locator(f"{row} .badge").inner_text() == "running"
    # Live usage arrives with the node's metrics samples.
    page.wait_for_selector(f"{row} td.metric .gauge", timeout=30_000)

    # The "New sandbox" button: a template chosen in the dialog.
    page.click("#new-sandbox")
    page.wait_for_selector(".dialog select[name='template'] option[value='base']", state="attached")
    page.select_option(".dialog select[name='template']", "base")
    page.click(".dialog button[type='submit']")
    page.wait_for_selector(".toast-ok:has-text('Created sandbox')")
    created = page.inner_text(".toast-ok:has-text('Created sandbox')").split()[2].rstrip(".")
    made.append(created)
    page.wait_for_selector(f"tr[data-sandbox-id='{created}']")

    # A paused one, for the list's states (paused through the API, seen in the list).
    third = _create(node, made)
    with node.client() as c:
        assert c.post(f"/sandboxes/{third}/pause").status_code == 204
    page.wait_for_selector(f"tr[data-sandbox-id='{third}'][data-state='paused']")
    page.wait_for_selector(f"{row} td.metric .gauge")
    if SHOTS:  # every running sandbox with its usage in the picture
        page.wait_for_function(
            "() => [...document.querySelectorAll('#sandbox-rows tr[data-state=running]')]"
            ".every((tr) => tr.querySelector('.gauge'))",
            timeout=30_000,
        )
    _shot(page, "sandboxes")

    page.select_option("#state-filter", "paused")
    page.wait_for_function(
        "(id) => document.querySelectorAll('#sandbox-rows tr[data-sandbox-id]').length === 1"
        " && document.querySelector(`tr[data-sandbox-id='${id}']`)",
        arg=third,
    )
    page.select_option("#state-filter", "running,paused")


def test_terminal_pause_and_resume(node: Server, made: list[str], page: Any) -> None:
    sandbox_id = made[0]
    page.click(f"tr[data-sandbox-id='{sandbox_id}'] a")
    page.wait_for_url(f"**/console/sandboxes/{sandbox_id}")
    _state(page, "running")
    page.wait_for_selector("#sandbox-details:has-text('purpose=console-test')")

    page.click("#btn-terminal")
    page.wait_for_selector("#terminal-status[data-state='connected']")
    page.click("#terminal")
    page.keyboard.type("echo hi-$((6*7))\n")
    _terminal_shows(page, "hi-42")
    assert "hi-$((6*7))" in page.evaluate("() => window.aenvTerminal.text()")
    page.wait_for_selector("#sandbox-logs .log:has-text('sandbox created')")
    page.keyboard.type("uname -sm; id -un\n")
    _terminal_shows(page, "Linux x86_64")
    _shot(page, "sandbox")

    page.click("#btn-pause")
    _state(page, "paused")
    page.wait_for_selector(".toast-ok:has-text('Paused')")
    assert page.is_disabled("#btn-pause") and page.is_enabled("#btn-resume")
    with node.client() as c:
        assert c.get(f"/sandboxes/{sandbox_id}").json()["state"] == "paused"
    # Past AENV_HIBERNATE_AFTER the sandbox is checkpointed and the terminal's stream cut.
    page.wait_for_selector("#terminal-status[data-state='detached']", timeout=60_000)

    page.click("#btn-resume")
    _state(page, "running")
    # The page re-attaches to the same shell once the sandbox runs again.
    page.wait_for_selector("#terminal-status[data-state='connected']")
    page.click("#terminal")
    page.keyboard.type("echo back-$((6*8))\n")
    _terminal_shows(page, "back-48")
    page.wait_for_selector("#sandbox-logs .log:has-text('sandbox resumed')")


def test_snapshot_fork_and_kill_buttons(node: Server, made: list[str], page: Any) -> None:
    sandbox_id = made[0]
    if not page.url.endswith(f"/console/sandboxes/{sandbox_id}"):
        page.goto(f"{node.url}/console/sandboxes/{sandbox_id}")
    _state(page, "running")
    name = f"console-snap-{os.getpid()}"
    page.click("#btn-snapshot")
    page.fill(".dialog input[name='name']", name)
    page.click(".dialog button[type='submit']")
    page.wait_for_selector(f".toast-ok:has-text('Snapshot {name} taken')", timeout=120_000)
    with node.client() as c:
        snaps = c.get("/snapshots", params={"name": name}).json()
    assert snaps, "the snapshot is listed by the API"
    made.append(f"snapshot:{snaps[0]['snapshotID']}")

    page.click("#btn-fork")
    page.fill(".dialog input[name='count']", "1")
    page.click(".dialog button[type='submit']")
    page.wait_for_selector(".toast-ok:has-text('Forked:')", timeout=120_000)
    child = page.locator(".toast-ok:has-text('Forked:') a").first.inner_text()
    made.append(child)

    # The fork tree: the child is below the parent on its page; the child's page shows what
    # it changed since the fork, as a list and a patch.
    page.wait_for_selector(f"#sandbox-lineage li[data-sandbox='{child}'] a")
    aenv(node, "exec", child, "--", "sh", "-c", "echo hello-from-child > /home/user/console.txt")
    page.goto(f"{node.url}/console/sandboxes/{child}")
    _state(page, "running")
    page.wait_for_selector(f"#sandbox-lineage li[data-sandbox='{sandbox_id}'] a")
    page.click("#btn-changes")
    page.wait_for_selector("#changes-list tr:has-text('/home/user/console.txt')")
    assert "+hello-from-child" in page.inner_text("#changes-patch")
    _shot(page, "sandbox-changes")
    page.goto(f"{node.url}/console/sandboxes/{sandbox_id}")
    _state(page, "running")

    # Kill asks first; cancelled, nothing happens.
    page.click("#btn-kill")
    page.click(".dialog button:has-text('Cancel')")
    page.goto(f"{node.url}/console/sandboxes/{child}")
    _state(page, "running")
    page.click("#btn-kill")
    page.click(".dialog button.btn-danger")
    page.wait_for_url("**/console/sandboxes")
    page.wait_for_selector(".toast-ok:has-text('Killed')")
    with node.client() as c:
        assert c.get(f"/sandboxes/{child}").status_code == 404
        assert c.get(f"/sandboxes/{sandbox_id}").json()["state"] == "running"

    page.click("nav a[href$='/snapshots']")
    page.wait_for_selector(f"#snapshots tr:has-text('{name}')")
    assert sandbox_id in page.inner_text(f"#snapshots tr:has-text('{name}')")
    _shot(page, "snapshots")


def test_templates_and_nodes_pages(node: Server, made: list[str], page: Any) -> None:
    page.click("nav a[href$='/templates']")
    page.wait_for_selector("#templates tr:has-text('base')")
    assert "ready" in page.inner_text("#templates tr:has-text('base')")
    _shot(page, "templates")

    page.click("nav a[href$='/nodes']")
    card = page.wait_for_selector("#nodes .card.node")
    assert card is not None
    text = card.inner_text()
    for label in ("CPU", "Memory", "Memory given", "Sandboxes", "ready"):
        assert label in text
    # The node's sandboxes: the one the terminal test used among them.
    page.wait_for_selector(f"#nodes .card.node a[href$='sandboxes/{made[0]}']")
    _shot(page, "nodes")
    page.click("#nodes .card.node h2 a")
    page.wait_for_selector(f"#node table.grid a[href$='sandboxes/{made[0]}']")

    # Log out: back to the login form, the key forgotten.
    page.click("#logout")
    page.wait_for_selector("#login-form")
    assert page.evaluate("() => sessionStorage.getItem('aenv.apiKey')") is None


def test_the_console_through_a_gateway(
    gateway: str, node: Server, made: list[str], page: Any
) -> None:
    """The gateway serves the console; its merged listings and its data plane (by the same
    routing headers) make the same pages and the terminal work through it."""
    page.goto(f"{gateway}/")
    assert page.url == f"{gateway}/console/"
    page.fill("#api-key", node.api_key)
    page.click("#login")
    sandbox_id = made[0]
    page.click(f"tr[data-sandbox-id='{sandbox_id}'] a")
    _state(page, "running")
    page.click("#btn-terminal")
    page.wait_for_selector("#terminal-status[data-state='connected']")
    page.click("#terminal")
    page.keyboard.type("echo via-gateway-$((6*7))\n")
    _terminal_shows(page, "via-gateway-42")

    page.click("nav a[href$='/nodes']")
    card = page.wait_for_selector(f"#nodes .card.node[data-node-id='{NODE_ID}']")
    assert card is not None and node.url in card.inner_text()  # the gateway's view: address
