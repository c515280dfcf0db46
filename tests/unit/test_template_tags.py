"""Template tags over a real catalog (builds/tags.py) and the image-alias table: which
build each name resolves to as builds, assignments and removals come and go."""

from __future__ import annotations

import asyncio
import builtins
import uuid
from pathlib import Path

import pytest

from aenv.builds.aliases import alias_for
from aenv.builds.store import BuildStore
from aenv.builds.tags import Tags, build_id_of, check_tags
from aenv.config import DEFAULT_IMAGE_ALIASES, Settings
from aenv.domain import BuildInfo, TemplateKind, TemplateRecord
from aenv.errors import BadRequest, NotFound
from aenv.orchestrator.catalog import Catalog


class _Templates:
    """The template registry's calls, over a real catalog."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    async def find(self, id_or_name: str) -> TemplateRecord | None:
        return await asyncio.to_thread(self.catalog.template, id_or_name)

    async def all(self) -> builtins.list[TemplateRecord]:
        return await asyncio.to_thread(self.catalog.templates)

    async def register(
        self, rec: TemplateRecord, *, publish: bool = True, exact_names: bool = False
    ) -> None:
        self.catalog.put_template(rec, exact_names=exact_names)


class _Orch:
    """The template calls of the orchestrator, over a real catalog."""

    def __init__(self, tmp: Path) -> None:
        self.catalog = Catalog(tmp / "catalog.db")
        self.templates = _Templates(self.catalog)

    async def delete_template(self, template_id: str) -> None:
        if not self.catalog.delete_template(template_id):
            raise NotFound(template_id)


TID = "tapp0000000000000000"


async def _build(tags: Tags, orch: _Orch, layer: str, build_tags: list[str]) -> str:
    """What finalize does with a finished build: returns its build id."""
    bid = str(uuid.uuid4())
    async with tags.placing(TID, bid, build_tags) as target:
        await orch.templates.register(
            TemplateRecord(
                template_id=target,
                kind=TemplateKind.TEMPLATE,
                layers=[layer],
                names=["app"] if target == TID else [],
                build=BuildInfo(build_id=bid, name="app"),
            )
        )
    return bid


def _layer(orch: _Orch, name: str) -> str | None:
    rec = orch.catalog.template(name)
    return rec.layers[0] if rec else None


async def test_tags_pin_builds_while_the_default_moves(tmp_path: Path) -> None:
    orch = _Orch(tmp_path)
    tags = Tags(BuildStore(tmp_path / "builds.db"), orch)  # type: ignore[arg-type]

    # The first build takes its tag and, the template having none, the default.
    b1 = await _build(tags, orch, "sha256:1", ["v1"])
    assert {r.tag: r.build_id for r in await tags.rows(TID)} == {"v1": b1, "default": b1}
    assert _layer(orch, "app") == _layer(orch, "app:v1") == _layer(orch, f"app:{b1}") == "sha256:1"

    # An untagged build moves the default; v1 stays on the first build.
    b2 = await _build(tags, orch, "sha256:2", [])
    assert _layer(orch, "app") == _layer(orch, "app:default") == "sha256:2"
    assert _layer(orch, "app:v1") == _layer(orch, f"app:{b1}") == "sha256:1"
    assert _layer(orch, f"app:{b2}") == "sha256:2"
    # One template for the user: its own record, and a pinned one behind the tag.
    pinned = orch.catalog.template("app:v1")
    assert pinned is not None and pinned.template_id != TID

    # Another tag on the pinned build; then removing both drops that build.
    assert await tags.assign(TID, "v1", ["prod"]) == b1
    assert _layer(orch, "app:prod") == "sha256:1"
    await tags.remove(TID, ["v1", "prod"])
    assert orch.catalog.template("app:v1") is None and orch.catalog.template(f"app:{b1}") is None
    assert [t.template_id for t in orch.catalog.templates()] == [TID]

    # A tagged build of a template that has a default leaves the default alone ...
    b3 = await _build(tags, orch, "sha256:3", ["v3"])
    assert _layer(orch, "app") == "sha256:2" and _layer(orch, "app:v3") == "sha256:3"
    # ... until the default is assigned to it: the build nobody tags any more is dropped.
    assert await tags.assign(TID, "v3", ["default"]) == b3
    assert _layer(orch, "app") == _layer(orch, "app:v3") == "sha256:3"
    assert orch.catalog.template(f"app:{b2}") is None
    assert [t.template_id for t in orch.catalog.templates()] == [TID]
    assert {r.tag for r in await tags.rows(TID)} == {"default", "v3"}

    with pytest.raises(NotFound, match="does not exist"):
        await tags.assign(TID, "nope", ["x"])
    await tags.forget(TID)


async def test_tags_of_a_template_made_before_tags(tmp_path: Path) -> None:
    """A record without tag rows (older node, `base`): its default and `name:tag` names."""
    orch = _Orch(tmp_path)
    tags = Tags(BuildStore(tmp_path / "builds.db"), orch)  # type: ignore[arg-type]
    rec = TemplateRecord(
        template_id="base", kind=TemplateKind.TEMPLATE, layers=["sha256:b"], names=["base"]
    )
    await orch.templates.register(rec)
    rows = await tags.rows("base")
    assert [r.tag for r in rows] == ["default"]
    bid = build_id_of(rec)
    assert rows[0].build_id == bid and str(uuid.UUID(bid)) == bid  # the SDK wants a UUID
    await tags.assign("base", None, ["stable"])
    assert orch.catalog.template("base:stable") == orch.catalog.template("base")


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
