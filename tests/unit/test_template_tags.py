"""Template tags (builds/tags.py) over a real orchestrator's template registry, and the
image-alias table: which build each name resolves to as builds, assignments and removals
come and go."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.builds.aliases import alias_for
from aenv.builds.store import BuildStore
from aenv.builds.tags import Tags, build_id_of, check_tags
from aenv.config import DEFAULT_IMAGE_ALIASES, Settings
from aenv.domain import BuildInfo, TemplateKind, TemplateRecord
from aenv.errors import BadRequest, NotFound
from tests.node_harness import Harness, started


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    """A real orchestrator (its template registry, catalog and layer holds) on the fake
    runtime; it has the template `base`."""
    async for h in started(tmp_path):
        yield h


@pytest.fixture
def tags(node: Harness) -> Tags:
    return Tags(BuildStore(node.home / "builds.db"), node.orch)


TID = "tapp0000000000000000"
# Layers by digest (the registry holds them, by name only: no layer is read here).
L1, L2, L3 = (f"sha256:{c * 64}" for c in "123")


async def _build(tags: Tags, node: Harness, layer: str, build_tags: list[str]) -> str:
    """What finalize does with a finished build: returns its build id."""
    bid = str(uuid.uuid4())
    async with tags.placing(TID, bid, build_tags) as target:
        await node.orch.templates.register(
            TemplateRecord(
                template_id=target,
                kind=TemplateKind.TEMPLATE,
                layers=[layer],
                names=["app"] if target == TID else [],
                build=BuildInfo(build_id=bid, name="app"),
            )
        )
    return bid


def _layer(node: Harness, name: str) -> str | None:
    rec = node.catalog.template(name)
    return rec.layers[0] if rec else None


def _templates(node: Harness) -> list[str]:
    return sorted(t.template_id for t in node.catalog.templates())


async def test_tags_pin_builds_while_the_default_moves(tags: Tags, node: Harness) -> None:
    # The first build takes its tag and, the template having none, the default.
    b1 = await _build(tags, node, L1, ["v1"])
    assert {r.tag: r.build_id for r in await tags.rows(TID)} == {"v1": b1, "default": b1}
    assert _layer(node, "app") == _layer(node, "app:v1") == _layer(node, f"app:{b1}") == L1

    # An untagged build moves the default; v1 stays on the first build.
    b2 = await _build(tags, node, L2, [])
    assert _layer(node, "app") == _layer(node, "app:default") == L2
    assert _layer(node, "app:v1") == _layer(node, f"app:{b1}") == L1
    assert _layer(node, f"app:{b2}") == L2
    # One template for the user: its own record, and a pinned one behind the tag.
    pinned = node.catalog.template("app:v1")
    assert pinned is not None and pinned.template_id != TID

    # Another tag on the pinned build; then removing both drops that build.
    assert await tags.assign(TID, "v1", ["prod"]) == b1
    assert _layer(node, "app:prod") == L1
    await tags.remove(TID, ["v1", "prod"])
    assert node.catalog.template("app:v1") is None and node.catalog.template(f"app:{b1}") is None
    assert _templates(node) == ["base", TID]

    # A tagged build of a template that has a default leaves the default alone ...
    b3 = await _build(tags, node, L3, ["v3"])
    assert _layer(node, "app") == L2 and _layer(node, "app:v3") == L3
    # ... until the default is assigned to it: the build nobody tags any more is dropped.
    assert await tags.assign(TID, "v3", ["default"]) == b3
    assert _layer(node, "app") == _layer(node, "app:v3") == L3
    assert node.catalog.template(f"app:{b2}") is None
    assert _templates(node) == ["base", TID]
    assert {r.tag for r in await tags.rows(TID)} == {"default", "v3"}

    with pytest.raises(NotFound, match="does not exist"):
        await tags.assign(TID, "nope", ["x"])
    await tags.forget(TID)


async def test_tags_of_a_template_made_before_tags(tags: Tags, node: Harness) -> None:
    """A record without tag rows (older node, the harness's `base`): its default and
    `name:tag` names."""
    rec = node.catalog.template("base")
    assert rec is not None
    rows = await tags.rows("base")
    assert [r.tag for r in rows] == ["default"]
    bid = build_id_of(rec)
    assert rows[0].build_id == bid and str(uuid.UUID(bid)) == bid  # the SDK wants a UUID
    await tags.assign("base", None, ["stable"])
    stable = node.catalog.template("base:stable")
    assert stable is not None and stable.layers == rec.layers
    assert stable == node.catalog.template("base")


@pytest.mark.parametrize("bad", [":invalid-tag", "app:", "", "a b", "x" * 65])
def test_invalid_tags_are_refused(bad: str) -> None:
    with pytest.raises(BadRequest):
        check_tags([bad])


def test_image_aliases() -> None:
    table = DEFAULT_IMAGE_ALIASES
    for image in ("e2bdev/base", "e2bdev/base:latest", "docker.io/e2bdev/base:2.1", "base"):
        assert alias_for(image, table) == "base"
    assert alias_for("e2bdev/code-interpreter:latest", table) == "code-interpreter-v1"
    for image in ("ubuntu:22.04", "quay.io/e2bdev/base", "e2bdev/basement", "Not A Ref"):
        assert alias_for(image, table) is None
    # A tagged entry wins over the repository's; a bad key matches nothing.
    pinned = {"e2bdev/base": "a", "e2bdev/base:1": "b", "::": "c"}
    assert alias_for("e2bdev/base:1", pinned) == "b" and alias_for("e2bdev/base:2", pinned) == "a"


def test_image_aliases_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AENV_HOME", str(tmp_path))
    assert Settings().images.image_aliases == DEFAULT_IMAGE_ALIASES
    monkeypatch.setenv("AENV_IMAGE_ALIASES", "e2bdev/base=mybase, python:3.12=py")
    assert Settings().images.image_aliases == {"e2bdev/base": "mybase", "python:3.12": "py"}
    monkeypatch.setenv("AENV_IMAGE_ALIASES", '{"e2bdev/base": "other"}')
    assert Settings().images.image_aliases == {"e2bdev/base": "other"}
    monkeypatch.delenv("AENV_IMAGE_ALIASES")
    (tmp_path / "config.toml").write_text('[images]\nimage_aliases = { "node:20" = "n" }\n')
    assert Settings().images.image_aliases == {"node:20": "n"}
