"""`code-interpreter-v1` built by the node at start (builds/autobuild.py), over the real API
and orchestrator on the fake runtime, with the build itself (a child `aenv template
build-code-interpreter`) replaced: a create of the template waits for a build in flight,
answers 503 with Retry-After past its patience, succeeds once the build is done, and a
failed build's reason is in the template's 404; other templates never wait."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.builds import autobuild
from aenv.builds.autobuild import CodeInterpreterAutobuild
from aenv.builds.builder import Builder
from aenv.server import node_app
from tests.node_harness import Harness, started
from tests.unit.api_node import API_KEY, assert_error


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    async for h in started(tmp_path, api_key=API_KEY, code_interpreter_autobuild=True):
        yield h


class FakeBuild:
    """Stands in for the child build: ends when told, registering the template on success."""

    def __init__(self, node: Harness) -> None:
        self.node = node
        self.outcome: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()
        self.runs = 0

    async def run(self) -> tuple[int, str]:
        self.runs += 1
        code, output = await self.outcome
        if code == 0:
            base = await self.node.orch.templates.get("base")
            await self.node.orch.templates.register(
                replace(base, template_id="tci", names=[autobuild.TEMPLATE])
            )
        return code, output


@contextlib.asynccontextmanager
async def api(
    node: Harness, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[httpx.AsyncClient, Builder, FakeBuild]]:
    fake = FakeBuild(node)

    async def serving(_self: CodeInterpreterAutobuild) -> None:
        return None

    async def build(_self: CodeInterpreterAutobuild) -> tuple[int, str]:
        return await fake.run()

    monkeypatch.setattr(CodeInterpreterAutobuild, "_build", build)
    monkeypatch.setattr(CodeInterpreterAutobuild, "_wait_serving", serving)
    monkeypatch.setattr(autobuild, "CREATE_PATIENCE", 0.3)
    app: Any = node_app(node.settings, node.orch)
    inner = app
    while not hasattr(inner, "openapi"):  # through the middleware and the data-plane router
        inner = getattr(inner, "app", None) or inner.control_app
    builder: Builder = inner.state.builder
    await builder.start()  # as the lifespan does: the build starts in the background
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://test",
            headers={"X-API-Key": API_KEY},
        ) as c:
            yield c, builder, fake
    finally:
        if not fake.outcome.done():
            fake.outcome.set_result((1, "stopped"))
        await builder.autobuild.close()


def ci_create(c: httpx.AsyncClient) -> Any:
    return c.post("/v2/sandboxes", json={"templateID": autobuild.TEMPLATE})


async def test_a_create_waits_for_the_build_then_succeeds(
    node: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with api(node, monkeypatch) as (c, builder, fake):
        await asyncio.sleep(0)
        assert builder.autobuild.state.status == "building" and fake.runs == 1
        # Past its patience: a 503 that says when to come back.
        r = await ci_create(c)
        body = assert_error(r, 503)
        assert r.headers["Retry-After"] == "30"
        assert "is being built" in body["message"]
        # Other templates do not wait.
        assert (await c.post("/v2/sandboxes", json={"templateID": "base"})).status_code == 201
        # A create that comes while it builds gets the sandbox once the build is done.
        waiting = asyncio.ensure_future(ci_create(c))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        fake.outcome.set_result((0, ""))
        r = await waiting
        assert r.status_code == 201, r.text
        assert builder.autobuild.state.status == "done"
        assert (await ci_create(c)).status_code == 201


async def test_a_failed_build_says_why_in_the_404(
    node: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with api(node, monkeypatch) as (c, builder, fake):
        fake.outcome.set_result((1, "apt-get: no network\nE: packages unavailable\n"))
        await asyncio.sleep(0.05)
        assert builder.autobuild.state.status == "failed"
        body = assert_error(await ci_create(c), 404)
        assert "E: packages unavailable" in body["message"]
        assert "aenv template build-code-interpreter" in body["message"]
        assert_error(await c.post("/v2/sandboxes", json={"templateID": "nope"}), 404)


async def test_off_the_node_builds_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    async def build(_self: CodeInterpreterAutobuild) -> tuple[int, str]:
        calls.append("build")
        return 0, ""

    monkeypatch.setattr(CodeInterpreterAutobuild, "_build", build)
    async for h in started(tmp_path, api_key=API_KEY):  # AENV_CODE_INTERPRETER_AUTOBUILD=0
        builder = Builder(h.settings, h.orch)
        await builder.start()
        await asyncio.sleep(0.05)
        assert calls == [] and builder.autobuild.state.status == "idle"
        await builder.autobuild.before_create(autobuild.TEMPLATE)  # no wait, no error
        await builder.close()


def test_the_build_aims_at_this_node_whatever_context_is_saved(tmp_path: Path) -> None:
    """`--url` of the node's own listener (a saved `aenv auth` context would win over the
    listen address), over loopback, its own certificate unchecked there."""
    from aenv.config import Settings

    plain = CodeInterpreterAutobuild(Settings(home=tmp_path, listen="0.0.0.0:8123"))
    argv, env = plain.command()
    assert argv[1:] == [
        "--url",
        "http://127.0.0.1:8123",
        "template",
        "build-code-interpreter",
        "--quiet",
    ]
    assert "AENV_TLS_VERIFY" not in env and env["AENV_HOME"] == str(tmp_path)
    (tmp_path / "c.pem").write_text("x")
    tls = CodeInterpreterAutobuild(
        Settings(
            home=tmp_path,
            listen="127.0.0.1:443",
            tls_cert=tmp_path / "c.pem",
            tls_key=tmp_path / "c.pem",
        )
    )
    argv, env = tls.command()
    assert argv[1:3] == ["--url", "https://127.0.0.1:443"] and env["AENV_TLS_VERIFY"] == "false"
