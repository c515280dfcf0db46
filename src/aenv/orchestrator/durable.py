"""Snapshots, templates and hibernated sandboxes in the durable repository (local or S3).

The node works from local files (layers in the layer store, checkpoint images under
$AENV_HOME/images); every snapshot/template is also published to the repository in the
background, checksummed. A hibernated sandbox is published the same way (kind
"hibernation", id `hib-<sandbox id>-<random>`) and gives its memory image up to the repository and
the node's bounded image cache; resuming it fetches the image back if the cache let it go. When a template's image or layers are missing locally (evicted,
or another node made it) they are fetched and verified before anything is restored, so a
corrupt or missing artifact is a clear error and never a half-restored sandbox. At start-up
the catalog learns every template the repository holds that it does not know yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Literal

from ..domain import TemplateKind, TemplateRecord
from ..snapshots import LayerRef, Manifest, SnapshotStore, Spec
from ..snapshots.artifacts import cancellable
from ..snapshots.errors import ArtifactError, SnapshotNotFound
from .catalog import Catalog
from .storage import SandboxStorage

log = logging.getLogger("aenv.durable")


class Durable:
    def __init__(
        self,
        store: SnapshotStore,
        catalog: Catalog,
        storage: SandboxStorage,
        image_complete: Callable[[Path], bool],
    ) -> None:
        self.store = store
        self.catalog = catalog
        self.storage = storage
        # The runtime's word on whether a directory holds a whole memory image.
        self._complete = image_complete
        self._publishing: dict[str, asyncio.Task[bool]] = {}

    async def start(self) -> None:
        await asyncio.to_thread(self.store.clean_staging)
        await self.learn()

    async def learn(self, id_or_name: str | None = None) -> bool:
        """Registers the templates and snapshots of the repository the catalog does not know
        yet (made by another node, or before this catalog): all, or only the one of this id
        or name. Whether any was."""
        try:
            manifests = await self.store.list()
        except Exception as e:
            log.warning("the snapshot repository could not be listed: %s", e)
            return False
        learned = False
        for m in manifests:
            if m.kind not in ("snapshot", "template"):
                continue
            if id_or_name is not None and id_or_name != m.id and id_or_name not in m.names:
                continue
            if await asyncio.to_thread(self.catalog.template, m.id) is not None:
                continue
            doc = dict((m.spec.model_extra or {}).get("doc") or {})
            if not doc:
                continue
            rec = TemplateRecord.from_doc(m.id, doc, m.names)
            rec.published = True
            await asyncio.to_thread(self.catalog.put_template, rec)
            await asyncio.to_thread(self.storage.hold, "template", m.id, m.layer_digests)
            log.info("template %s registered from the repository", m.id)
            learned = True
        return learned

    async def record(self, manifest_id: str) -> TemplateRecord:
        """The template document a manifest carries (a hibernation's, for another node)."""
        m = await self.store.get(manifest_id)
        doc = dict((m.spec.model_extra or {}).get("doc") or {})
        if not doc:
            raise SnapshotNotFound(manifest_id)
        rec = TemplateRecord.from_doc(m.id, doc, m.names)
        rec.published = True
        return rec

    async def close(self) -> None:
        if self._publishing:
            await asyncio.gather(*self._publishing.values(), return_exceptions=True)

    def publish_later(self, rec: TemplateRecord) -> asyncio.Task[bool]:
        """Publishes in the background; the task's result says whether it worked."""
        template_id = rec.template_id
        task = asyncio.create_task(self._publish(rec))
        self._publishing[template_id] = task
        task.add_done_callback(lambda _t: self._publishing.pop(template_id, None))
        return task

    async def wait_published(self, template_id: str) -> None:
        task = self._publishing.get(template_id)
        if task is not None:
            await asyncio.shield(task)

    async def _publish(self, rec: TemplateRecord) -> bool:
        template_id = rec.template_id
        try:
            image = None
            if rec.checkpoint is not None:
                image = self.storage.image_dir(rec.checkpoint)
            doc = rec.to_doc()
            doc.pop("published", None)
            kind: Literal["snapshot", "template", "hibernation"] = "template"
            if rec.kind is TemplateKind.SNAPSHOT:
                kind = "snapshot"
            elif rec.kind is TemplateKind.HIBERNATION:
                kind = "hibernation"
            manifest = Manifest(
                id=template_id,
                kind=kind,
                parent=rec.parent,
                layers=[LayerRef(digest=d) for d in rec.layers],
                spec=Spec.model_validate(
                    {
                        "cpu_count": rec.cpu_count,
                        "memory_mb": rec.memory_mb,
                        "env": dict(rec.env),
                        "workdir": rec.workdir,
                        "user": rec.user,
                        # The whole template document, so another node can register it.
                        "doc": doc,
                    }
                ),
                names=list(rec.names),
            )
            with cancellable() as stop:
                try:
                    await self.store.publish(manifest, checkpoint_dir=image)
                except asyncio.CancelledError:
                    stop.set()  # the packing thread stops too
                    raise
            current = await asyncio.to_thread(self.catalog.template, template_id)
            if current is not None:
                current.published = True
                await asyncio.to_thread(self.catalog.put_template, current)
            log.info("template %s published to the repository", template_id)
            return True
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("publishing template %s failed", template_id)
            return False

    async def hand_over(self, image_id: str) -> None:
        """Moves the node's copy of a published memory image into the bounded image cache
        (which may evict it later: `local_image` fetches it back from the repository)."""
        local = self.storage.image_dir(image_id)
        if not self._complete(local):
            return
        manifest = await self.store.get(image_id)
        await asyncio.to_thread(self.store.adopt_image, manifest, local)
        await asyncio.to_thread(self.storage.remove_image, image_id)

    async def image_for(self, rec: TemplateRecord) -> Path:
        """The local directory of a template's checkpoint image, fetched if needed."""
        assert rec.checkpoint is not None
        local = self.storage.image_dir(rec.checkpoint)
        if self._complete(local):
            return local
        await self.wait_published(rec.template_id)
        return await self._fetch_image(rec.template_id, f"template {rec.template_id!r}")

    @contextlib.asynccontextmanager
    async def local_image(self, image_id: str) -> AsyncIterator[Path]:
        """A hibernated sandbox's memory image as a local directory for as long as the
        context lasts: the node's own copy, else the cached or downloaded one (pinned)."""
        local = self.storage.image_dir(image_id)
        if self._complete(local):
            yield local
            return
        with self.store.pin(image_id):
            yield await self._fetch_image(image_id, f"hibernated sandbox image {image_id!r}")

    async def _fetch_image(self, manifest_id: str, what: str) -> Path:
        try:
            _m, path = await self.store.fetch(manifest_id)
        except SnapshotNotFound as e:
            raise ArtifactError(
                f"the memory image of {what} is neither on this node nor in the repository",
                snapshot_id=manifest_id,
                artifact="checkpoint",
            ) from e
        if path is None:
            raise ArtifactError(
                f"{what} has no memory image in the repository",
                snapshot_id=manifest_id,
                artifact="checkpoint",
            )
        return path

    async def ensure_layers(self, rec: TemplateRecord) -> None:
        missing = [d for d in rec.layers if not self.storage.layers.has(d)]
        if not missing:
            return
        await self.wait_published(rec.template_id)
        manifest = await self.store.get(rec.template_id)
        await self.store.ensure_layers(manifest)

    async def forget(self, template_id: str) -> None:
        task = self._publishing.get(template_id)
        if task is not None:
            task.cancel()  # what it uploaded so far is swept with the rest below
            await asyncio.gather(task, return_exceptions=True)
        try:
            await self.store.delete(template_id)
        except SnapshotNotFound:
            pass
        except Exception:
            log.exception("deleting template %s from the repository failed", template_id)
