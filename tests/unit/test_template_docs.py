"""Template documents written before the builder's, fork's and hibernation's data were typed
(`tests/fixtures/template_docs_untyped.json`, made by that code: a build, a build from an
image, `base`, a tag's pinned copy, a fork's snapshot, a hibernation with its sandbox's
record, a cold start's image template, the code interpreter's rootfs) load into the typed
fields, and what the typed record writes reads back the same and keeps the old keys."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from aenv.domain import BuildInfo, PauseTier, SandboxState, TemplateRecord

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "template_docs_untyped.json"


@pytest.fixture(scope="module")
def docs() -> dict[str, dict[str, Any]]:
    loaded: dict[str, dict[str, Any]] = json.loads(FIXTURE.read_text())
    return loaded


def load(docs: dict[str, dict[str, Any]], template_id: str) -> TemplateRecord:
    return TemplateRecord.from_doc(template_id, docs[template_id])


def test_a_builds_record(docs: dict[str, dict[str, Any]]) -> None:
    rec = load(docs, "tbuilt")
    assert rec.build == BuildInfo(
        build_id="1b0c6a55-8b7e-4d55-9d0e-0c3f2e1a0b01",
        name="app",
        status="ready",
        start_cmd="serve",
        ready_cmd="curl -sf localhost",
        metadata={"team": "rl"},
        from_template="base",
    )
    assert rec.build.origin == "base"
    image = load(docs, "timage").build
    assert (image.from_image, image.image, image.image_digest) == (
        "python:3.12",
        "docker.io/library/python:3.12",
        "sha256:dd",
    )
    assert image.start_cmd is None and image.origin == "python:3.12"


def test_built_in_templates(docs: dict[str, dict[str, Any]]) -> None:
    base = load(docs, "base").build
    assert (base.source, base.recipe_hash, base.size) == (
        "debootstrap minbase bookworm",
        "abc123",
        12345,
    )
    rootfs = load(docs, "code-interpreter-rootfs").build
    assert (rootfs.source, rootfs.rootfs_stamp) == ("aenv code interpreter", "stamp1")
    # A cold start's image template kept the whole image; its reference is what is read.
    assert load(docs, "icold00000000000001").build.image == "docker.io/library/alpine:3"


def test_pins_forks_and_hibernations(docs: dict[str, dict[str, Any]]) -> None:
    pinned = load(docs, "tbuilt.1b0c6a55-8b7e-4d55-9d0e-0c3f2e1a0b01")
    assert pinned.pinned_of == "tbuilt" and pinned.build.name == "app"
    assert load(docs, "ifork0000000000000001").fork_of == "isbxold0000000000001"
    assert load(docs, "tbuilt").fork_of is None and load(docs, "tbuilt").pinned_of is None
    hib = load(docs, "ihib000000000000001").hibernated
    assert hib is not None
    assert hib.sandbox_id == "isbxold0000000000001" and hib.owner == "team"
    assert hib.state is SandboxState.PAUSED and hib.instance is None
    assert hib.paused is not None and hib.paused.tier is PauseTier.HIBERNATED
    assert hib.started_at == datetime(2026, 12, 5, 6, 0, tzinfo=UTC)
    assert not hib.egress.allow_internet and hib.envd_access_token == "tok-1"


def test_what_is_written_reads_back_and_keeps_the_old_keys(
    docs: dict[str, dict[str, Any]],
) -> None:
    for template_id, old in docs.items():
        rec = TemplateRecord.from_doc(template_id, old)
        new = rec.to_doc()
        assert TemplateRecord.from_doc(template_id, new) == rec
        # Every key an older node reads is still there with its value (a cold start's
        # image, transient and read by no one, is kept as its reference).
        kept = {k: v for k, v in old.items() if v is not None and k != "image"}
        assert {k: _within(new.get(k), v) for k, v in kept.items()} == kept, template_id


def _within(new: Any, old: Any) -> Any:
    """`new` cut to the keys `old` has, nested (a key a later version added to a nested
    record, such as a hibernated sandbox's, is nothing an older node reads)."""
    if isinstance(new, dict) and isinstance(old, dict):
        return {k: _within(new.get(k), v) for k, v in old.items()}
    return new
