"""Template tags as E2B has them: each tag of a template points at one of its ready builds.

`default` is the tag a build without tags takes, and what the bare name resolves to. A build
with tags (`name:v1`, `tags=[...]`) takes those (and `default` too when the template has
none yet); the next untagged build moves `default` and leaves the tagged build where it is.

The catalog is kept in step with the tag table (store.py), so creates resolve through it:
the default build's record is the template itself (`template_id`, names `name`,
`name:default`, ...); a build that only tags point at is a second record of the same
layers and memory image, `{template_id}.{build_id}`, unlisted (`pinned_of`). Every
record is also named `name:{build_id}`. A build no tag points at any more is dropped.
Templates made without the build API (`base`, pulled images) have one build, named by
a UUID derived from their id.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from ..domain import TemplateRecord
from ..errors import BadRequest, NotFound
from ..orchestrator import Orchestrator
from .store import BuildStore, TagRow

DEFAULT_TAG = "default"
TAG_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_UUID_NS = uuid.UUID("0d4c6f1e-5a0b-4f39-9a51-2f7c9f3c1a10")


def split_name(name: str) -> tuple[str, str | None]:
    """`name:tag` -> (name, tag); a `:` inside a registry-like host part is not a tag."""
    base, sep, tag = name.rpartition(":")
    if sep and tag and "/" not in tag and base:
        return base, tag
    return name, None


def check_tags(tags: list[str]) -> list[str]:
    out: list[str] = []
    for t in tags:
        if not isinstance(t, str) or not TAG_RE.match(t):
            raise BadRequest(f"invalid tag {t!r}: use letters, digits and _.- (max 64 chars)")
        if t not in out:
            out.append(t)
    if not out:
        raise BadRequest("no tags given")
    return out


def pinned_id(template_id: str, build_id: str) -> str:
    return f"{template_id}.{build_id}"


def build_id_of(rec: TemplateRecord) -> str:
    """The build a record holds: the build API's id, or one derived from the template id."""
    bid = rec.build.build_id
    if bid is not None:
        with contextlib.suppress(ValueError):
            return str(uuid.UUID(bid))
    owner = rec.pinned_of or rec.template_id
    return str(uuid.uuid5(_UUID_NS, owner))


def owner_of(rec: TemplateRecord) -> str:
    """The template a record belongs to (itself, or the one whose build it pins)."""
    return rec.pinned_of or rec.template_id


def main_name(rec: TemplateRecord) -> str | None:
    """The template's name without tag."""
    name = rec.build.name
    if name:
        return name
    plain = [n for n in rec.names if split_name(n)[1] is None]
    return plain[0] if plain else (rec.names[0] if rec.names else None)


class Tags:
    def __init__(self, store: BuildStore, orch: Orchestrator) -> None:
        self.store = store
        self.orch = orch
        self._locks: dict[str, asyncio.Lock] = {}

    def lock(self, template_id: str) -> asyncio.Lock:
        return self._locks.setdefault(template_id, asyncio.Lock())

    # ------------------------------------------------------------------ reading
    async def records(self, template_id: str) -> dict[str, TemplateRecord]:
        """The template's catalog records by build id."""
        out: dict[str, TemplateRecord] = {}
        for t in await self.orch.templates.all():
            mine = owner_of(t) == template_id or t.template_id == pinned_id(
                template_id, build_id_of(t)
            )  # the latter: a build just registered under its pinned id (`placing`)
            if t.internal or not mine:
                continue
            # The template's own record wins over a stale pinned copy of the same build.
            bid = build_id_of(t)
            if bid not in out or t.template_id == template_id:
                out[bid] = t
        return out

    async def rows(self, template_id: str) -> list[TagRow]:
        """The tag table of a template, seeded from its catalog record the first time (a
        template made before tags existed, or without the build API: `default` and the
        `name:tag` names it has)."""
        rows = await asyncio.to_thread(self.store.tags, template_id)
        if rows:
            return rows
        rec = await self.orch.templates.find(template_id)
        if rec is None or rec.internal or rec.template_id != template_id:
            return []
        name = main_name(rec)
        tags = [DEFAULT_TAG]
        for n in rec.names:
            base, tag = split_name(n)
            if tag and base == name and TAG_RE.match(tag) and tag not in tags:
                tags.append(tag)
        await asyncio.to_thread(self.store.set_tags, template_id, build_id_of(rec), tags)
        return await asyncio.to_thread(self.store.tags, template_id)

    # ------------------------------------------------------------------ changing
    @contextlib.asynccontextmanager
    async def placing(self, template_id: str, build_id: str, tags: list[str]) -> AsyncIterator[str]:
        """Around registering a finished build: yields the id to register it under (the
        template's when it takes `default`), first pinning the current default build if
        tags stay on it; afterwards points the tags at the build and syncs the catalog."""
        async with self.lock(template_id):
            rows = await self.rows(template_id)
            current = {r.tag: r.build_id for r in rows}
            tags = list(tags) or [DEFAULT_TAG]
            if DEFAULT_TAG not in current and DEFAULT_TAG not in tags:
                tags.append(DEFAULT_TAG)
            takes_default = DEFAULT_TAG in tags
            if takes_default and DEFAULT_TAG in current:
                old = current[DEFAULT_TAG]
                left = [t for t, b in current.items() if b == old and t not in tags]
                if left and old != build_id:
                    await self._pin(template_id, old, left)
            yield template_id if takes_default else pinned_id(template_id, build_id)
            await asyncio.to_thread(self.store.set_tags, template_id, build_id, tags)
            await self._sync(template_id)

    async def assign(self, template_id: str, source: str | None, tags: list[str]) -> str:
        """Points `tags` at the build `source` (a tag, a build id; None: `default`) names."""
        tags = check_tags(tags)
        async with self.lock(template_id):
            rows = await self.rows(template_id)
            recs = await self.records(template_id)
            want = source or DEFAULT_TAG
            by_tag = {r.tag: r.build_id for r in rows}
            bid = by_tag.get(want) or (want if want in recs else None)
            if bid is None or bid not in recs:
                raise NotFound(f"tag {want!r} does not exist for template {template_id!r}")
            if DEFAULT_TAG in tags and by_tag.get(DEFAULT_TAG) not in (None, bid):
                old = by_tag[DEFAULT_TAG]
                left = [t for t, b in by_tag.items() if b == old and t not in tags]
                if left:
                    await self._pin(template_id, old, left)
            await asyncio.to_thread(self.store.set_tags, template_id, bid, tags)
            await self._sync(template_id)
            return bid

    async def remove(self, template_id: str, tags: list[str]) -> None:
        tags = check_tags(tags)
        async with self.lock(template_id):
            await self.rows(template_id)
            await asyncio.to_thread(self.store.remove_tags, template_id, tags)
            await self._sync(template_id)

    async def forget(self, template_id: str) -> None:
        """The template is being deleted: drops the records of its pinned builds."""
        async with self.lock(template_id):
            for rec in (await self.records(template_id)).values():
                if rec.template_id != template_id:
                    with contextlib.suppress(NotFound):
                        await self.orch.delete_template(rec.template_id)
        self._locks.pop(template_id, None)

    # ------------------------------------------------------------------ the catalog
    async def _pin(self, template_id: str, build_id: str, tags: list[str]) -> None:
        """A record of the build under its pinned id (before the template's own record is
        replaced by another build), named by the tags that stay on it."""
        recs = await self.records(template_id)
        src = recs.get(build_id)
        if src is None or src.template_id != template_id:
            return
        await self._put(template_id, src, pinned_id(template_id, build_id), tags)

    async def _put(
        self, template_id: str, src: TemplateRecord, target: str, tags: list[str]
    ) -> None:
        name = main_name(src) or template_id
        bid = build_id_of(src)
        names = [f"{name}:{t}" for t in tags] + [f"{name}:{bid}"]
        build = replace(src.build, build_id=src.build.build_id or bid, name=name)
        pinned_of = None if target == template_id else template_id
        if pinned_of is None:
            names.insert(0, name)
        rec = replace(src, template_id=target, names=names, build=build, pinned_of=pinned_of)
        if rec == src:
            return
        # A copy under another id is published as its own; the record itself was published
        # when it was registered (its names there may lag: only other nodes read them).
        moved = src.template_id != target
        await self.orch.templates.register(
            replace(rec, published=False) if moved else rec, publish=moved, exact_names=True
        )

    async def _sync(self, template_id: str) -> None:
        """Makes the catalog match the tag table: each tagged build a record (under the
        template's id if it has `default`), named by its tags; untagged builds dropped."""
        rows = await asyncio.to_thread(self.store.tags, template_id)
        recs = await self.records(template_id)
        by_build: dict[str, list[str]] = {}
        for r in rows:
            by_build.setdefault(r.build_id, []).append(r.tag)
        gone = [b for b in by_build if b not in recs]
        if gone:  # a tag on a build that no longer has files (cannot be created from)
            stale = [t for b in gone for t in by_build.pop(b)]
            await asyncio.to_thread(self.store.remove_tags, template_id, stale)
        targets = {
            b: template_id if DEFAULT_TAG in tags else pinned_id(template_id, b)
            for b, tags in by_build.items()
        }
        # Pinned copies first: the template's own record may be one of their sources.
        for b, target in sorted(targets.items(), key=lambda kv: kv[1] == template_id):
            await self._put(template_id, recs[b], target, by_build[b])
        keep = set(targets.values())
        for rec in recs.values():
            if rec.template_id not in keep:
                with contextlib.suppress(NotFound, BadRequest):
                    await self.orch.delete_template(rec.template_id)
        # A pinned copy of the same build as the template's own record.
        for t in await self.orch.templates.all():
            if t.pinned_of == template_id and t.template_id not in keep and not t.internal:
                with contextlib.suppress(NotFound, BadRequest):
                    await self.orch.delete_template(t.template_id)
