"""Templates (and snapshots, which are templates with memory): the catalog entries, the layer
references that keep their layers from eviction, their memory images, and their durable copy
in the repository (published in the background when there is one)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from ..domain import TemplateKind, TemplateRecord
from ..errors import NotFound
from ..snapshots.errors import SnapshotNotFound
from .catalog import Catalog
from .durable import Durable
from .storage import SandboxStorage

log = logging.getLogger("aenv.orchestrator")


class TemplateRegistry:
    def __init__(
        self,
        catalog: Catalog,
        storage: SandboxStorage,
        durable: Durable | None,
        image_complete: Callable[[Path], bool],
    ) -> None:
        self.catalog = catalog
        self.storage = storage
        self.durable = durable
        self._complete = image_complete

    async def start(self) -> None:
        if self.durable is not None:
            await self.durable.start()
        for t in await self.all():
            await asyncio.to_thread(self.storage.hold, "template", t.template_id, t.layers)

    async def close(self) -> None:
        if self.durable is not None:
            await self.durable.close()

    # ------------------------------------------------------------------ queries
    async def find(self, id_or_name: str) -> TemplateRecord | None:
        return await asyncio.to_thread(self.catalog.template, id_or_name)

    async def get(self, id_or_name: str) -> TemplateRecord:
        found = await self.find(id_or_name)
        if found is None and self.durable is not None and await self.durable.learn(id_or_name):
            found = await self.find(id_or_name)  # another node built it
        if found is None:
            name, sep, tag = id_or_name.rpartition(":")
            if sep and name and tag and "/" not in tag:
                # E2B's words, which clients waiting for a tagged build look for.
                raise NotFound(f"tag {tag!r} does not exist for template {name!r}")
            raise NotFound(f"template {id_or_name!r} not found")
        return found

    async def all(self) -> list[TemplateRecord]:
        return await asyncio.to_thread(self.catalog.templates)

    async def snapshots(
        self, sandbox_id: str | None = None, name: str | None = None
    ) -> list[TemplateRecord]:
        """The user's snapshots, oldest first."""
        out = [
            t
            for t in await self.all()
            if t.kind is TemplateKind.SNAPSHOT
            and not t.internal
            and (not sandbox_id or t.sandbox_id == sandbox_id)
            and (not name or name in t.names)
        ]
        out.sort(key=lambda t: (str(t.created_at), t.template_id))
        return out

    async def get_snapshot(self, id_or_name: str) -> TemplateRecord:
        found = await self.find(id_or_name)
        if found is None or found.kind is not TemplateKind.SNAPSHOT or found.internal:
            raise NotFound(f"snapshot {id_or_name!r} not found")
        return found

    # ------------------------------------------------------------------ changes
    async def register(
        self, rec: TemplateRecord, *, publish: bool = True, exact_names: bool = False
    ) -> None:
        """Adds or replaces a template: its layer references (an earlier version's are
        dropped), the catalog entry (`exact_names`: its names are `rec.names` and no
        others), a memory image the new version no longer uses (unless another template
        shares it), and — unless internal — its copy in the repository."""
        old = await self.find(rec.template_id)
        if old is not None and old.template_id == rec.template_id:
            await asyncio.to_thread(self.storage.release, "template", rec.template_id)
            if rec.standby_after is None:  # a rebuild keeps what its owner set
                rec.standby_after = old.standby_after
        await asyncio.to_thread(self.storage.hold, "template", rec.template_id, rec.layers)
        await asyncio.to_thread(self.catalog.put_template, rec, exact_names=exact_names)
        if old is not None and old.checkpoint and old.checkpoint != rec.checkpoint:
            await self._remove_image_unless_shared(old.checkpoint, rec.template_id)
        if publish and self.durable is not None and not rec.internal:
            self.durable.publish_later(rec)

    async def set_standby(self, id_or_name: str, seconds: float | None) -> TemplateRecord:
        """Seconds idle before standby for the template's new sandboxes that set none
        (None: the node's `AENV_STANDBY_AFTER`; 0: never)."""
        rec = await self.get(id_or_name)
        rec.standby_after = seconds
        await self.update(rec)
        return rec

    async def update(self, rec: TemplateRecord) -> None:
        """Stores a changed setting of a template (same layers and image), everywhere."""
        await asyncio.to_thread(self.catalog.put_template, rec)
        if self.durable is not None and not rec.internal:
            self.durable.publish_later(rec)

    async def delete(self, rec: TemplateRecord) -> None:
        await asyncio.to_thread(self.catalog.delete_template, rec.template_id)
        await asyncio.to_thread(self.storage.release, "template", rec.template_id)
        if self.durable is not None and not rec.internal:
            # First: a publish in flight still reads the image.
            await self.durable.forget(rec.template_id)
        if rec.checkpoint:
            await self._remove_image_unless_shared(rec.checkpoint, rec.template_id)

    async def _remove_image_unless_shared(self, image: str, template_id: str) -> None:
        """A build pinned by a tag is a second record on the same memory image."""
        others = [
            t for t in await self.all() if t.checkpoint == image and t.template_id != template_id
        ]
        if not others:
            await asyncio.to_thread(self.storage.remove_image, image)

    # ------------------------------------------------------------------ artifacts
    @property
    def has_repository(self) -> bool:
        return self.durable is not None

    def local_image(self, rec: TemplateRecord) -> Path:
        """Where the node keeps the memory image of a template that is never published."""
        assert rec.checkpoint is not None
        return self.storage.image_dir(rec.checkpoint)

    async def ensure_layers(self, rec: TemplateRecord) -> None:
        """Fetches the layers this node lacks from the repository."""
        if self.durable is not None:
            await self.durable.ensure_layers(rec)

    async def image_of(self, rec: TemplateRecord) -> Path:
        """The local directory of the template's memory image (fetched if needed)."""
        assert rec.checkpoint is not None
        if self.durable is not None:
            return await self.durable.image_for(rec)
        return self.storage.image_dir(rec.checkpoint)

    async def fresh_image(self, name: str) -> Path:
        """An empty place for a new memory image."""
        return await asyncio.to_thread(self.storage.fresh_image_dir, name)

    async def link_image(self, src: Path, name: str) -> None:
        await asyncio.to_thread(self.storage.link_image, src, name)

    @contextlib.asynccontextmanager
    async def hibernation_image(self, name: str, what: str) -> AsyncIterator[Path]:
        """A hibernated sandbox's memory image, local for as long as the context lasts."""
        if self.durable is not None:
            async with self.durable.local_image(name) as path:
                yield path
            return
        image = self.storage.image_dir(name)
        if not self._complete(image):
            raise NotFound(f"the memory image of {what} is missing")
        yield image

    async def hibernation(self, name: str) -> TemplateRecord:
        """A hibernation's record from the repository (another node's sandbox)."""
        if self.durable is None:
            raise NotFound("this node has no snapshot repository")
        try:
            return await self.durable.record(name)
        except SnapshotNotFound as e:
            raise NotFound(f"hibernation {name!r} is not in the repository") from e

    def publish(self, rec: TemplateRecord) -> asyncio.Task[bool] | None:
        """Publishes a record that is not in the catalog (a hibernation); None without a
        repository."""
        return None if self.durable is None else self.durable.publish_later(rec)

    async def hand_over(self, name: str) -> None:
        """After a publish: the node keeps the image only in its bounded cache."""
        if self.durable is not None:
            await self.durable.hand_over(name)

    async def drop_image(self, name: str) -> None:
        """Removes a memory image from the repository and the node."""
        if self.durable is not None:
            await self.durable.forget(name)  # first: a publish in flight still reads it
        await asyncio.to_thread(self.storage.remove_image, name)
