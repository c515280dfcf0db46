"""`SnapshotStore`: publishing snapshots to the repository and fetching them onto this node.

- **publish** (`publishing.Publisher`) uploads only what the repository lacks, then writes
  the manifest last;
- **fetch** (`fetching.Fetcher`) makes a snapshot usable here: layers in the layer store,
  the memory image in the bounded image cache, every object verified first;
- **delete** removes the manifest, then sweeps objects that no remaining manifest
  references (`sweeping`, mark and sweep over all manifests).

The parts share one `context.StoreContext` (repository, stores, locks, sweep guard).
"""

from __future__ import annotations

import builtins
import contextlib
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

from ..config import SnapshotSettings
from ..fsutil import rmtree
from ..images.layers import LayerStore
from .artifacts import Compression
from .cache import ImageCache
from .context import StoreContext
from .fetching import Fetcher
from .manifest import Manifest, manifest_key
from .publishing import Publisher
from .repos.base import Repository
from .sweeping import sweep


class SnapshotStore:
    def __init__(
        self,
        settings: SnapshotSettings,
        repository: Repository,
        layer_store: LayerStore,
        *,
        cache_dir: Path,
        cache_size: int | None = None,
    ) -> None:
        """`cache_dir` holds the image cache and the work dir (one file system, so
        installing a fetched image is a rename); `cache_size` overrides the configured
        bound."""
        self.settings = settings
        self.repository = repository
        self.layers = layer_store
        self.work = cache_dir / "tmp"
        self.cache = ImageCache(
            cache_dir / "images",
            int(settings.snapshot_cache_size) if cache_size is None else cache_size,
            tmp=self.work,
        )
        self._ctx = StoreContext(settings, repository, layer_store, self.cache, self.work)
        self._publisher = Publisher(self._ctx)
        self._fetcher = Fetcher(self._ctx)

    @property
    def layer_compression(self) -> Compression:
        return self._publisher.layer_compression

    @property
    def image_compression(self) -> Compression:
        return self._publisher.image_compression

    def pin(self, snapshot_id: str) -> contextlib.AbstractContextManager[None]:
        """``with store.pin(id):`` — the id's memory image stays in the cache meanwhile.
        Pin *before* `fetch` and hold it while a sandbox may read the image."""
        return self.cache.pin(snapshot_id)

    def clean_staging(self) -> None:
        """Removes leftovers of interrupted publishes/fetches. Call once at startup."""
        self.cache.clean_staging()
        if self.work.is_dir():
            for entry in self.work.iterdir():
                rmtree(entry)
        clean = getattr(self.repository, "clean_staging", None)
        if callable(clean):
            clean()

    # --- reading manifests ---
    async def get(self, snapshot_id: str) -> Manifest:
        return await self._ctx.get(snapshot_id)

    async def exists(self, snapshot_id: str) -> bool:
        return await self.repository.exists(manifest_key(snapshot_id))

    async def list(self, kind: str | None = None) -> builtins.list[Manifest]:
        """All manifests (oldest first), optionally of one kind. Unreadable ones are logged
        and skipped."""
        ms = await self._ctx.all_manifests(strict=False)
        if kind is not None:
            ms = [m for m in ms if m.kind == kind]
        ms.sort(key=lambda m: (m.created_at, m.id))
        return ms

    # --- publishing and fetching ---
    async def publish(
        self,
        manifest: Manifest,
        layer_dirs: Mapping[str, Path] | None = None,
        checkpoint_dir: Path | None = None,
        *,
        move_checkpoint: bool = False,
    ) -> Manifest:
        """Stores a snapshot and returns its completed manifest.

        `manifest.layers` lists the layer digests, topmost first (their `object` may be
        None: this fills it in). A layer's files come from `layer_dirs[digest]`, else from
        the local layer store; a layer the repository has already is not uploaded again.
        `checkpoint_dir` is a memory image (a directory of regular files), stored under
        ``images/<id>/``; with move_checkpoint=True the caller gives it up: its files may be
        moved into the repository and into the image cache instead of copied.
        Re-publishing an existing id replaces it (the old objects are swept).
        """
        return await self._publisher.publish(
            manifest, layer_dirs, checkpoint_dir, move_checkpoint=move_checkpoint
        )

    def adopt_image(self, manifest: Manifest, image_dir: Path) -> None:
        """Puts a local copy of a published snapshot's memory image into the image cache
        (moved, or linked to a local repository's objects), as if it had been fetched. The
        caller gives `image_dir` up. Sync."""
        self._publisher.adopt_image(manifest, image_dir)

    async def fetch(self, snapshot_id: str) -> tuple[Manifest, Path | None]:
        """Makes a snapshot usable on this node: every layer in the local layer store, the
        memory image (if any) in the image cache. Returns the manifest and the image's
        directory (None for a filesystem-only snapshot)."""
        return await self._fetcher.fetch(snapshot_id)

    async def ensure_layers(self, manifest: Manifest) -> None:
        await self._fetcher.ensure_layers(manifest)

    # --- deleting ---
    async def delete(self, snapshot_id: str) -> None:
        """Deletes the manifest, then every object no remaining manifest references."""
        m = await self.get(snapshot_id)
        await self.repository.delete(m.key)
        await sweep(
            self._ctx, {o.key for o in m.objects()}, grace=self.settings.snapshot_gc_grace_seconds
        )
        self.cache.remove(snapshot_id)

    async def gc(self, grace: float | None = None) -> builtins.list[str]:
        """Removes objects no manifest references that are older than `grace` seconds
        (leftovers of crashed publishes). Returns the deleted keys."""
        g = self.settings.snapshot_gc_grace_seconds if grace is None else grace
        return await sweep(self._ctx, set(), grace=g)

    # --- introspection ---
    def cache_usage(self) -> int:
        return self.cache.usage()

    def cached_images(self) -> Iterator[tuple[str, Path]]:
        for e in self.cache.entries():
            yield e.snapshot_id, e.path

    async def object_usage(self) -> Counter[str]:
        """Stored bytes per top-level prefix (manifests, layers, images)."""
        c: Counter[str] = Counter()
        for o in await self.repository.list():
            c[o.key.split("/", 1)[0]] += o.size
        return c
