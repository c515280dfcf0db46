"""What the parts of a `SnapshotStore` share: the repository, the local stores, the work
dir, per-artifact locks, the sweep guard, and reading manifests back."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ..config import SnapshotSettings
from ..images.layers import LayerStore
from .cache import ImageCache
from .errors import ArtifactError, ManifestCorrupt, ObjectNotFound, SnapshotNotFound
from .guard import SweepGuard
from .manifest import Manifest, check_id, manifest_key
from .repos.base import Repository

# One logger for the store and its parts.
log = logging.getLogger("aenv.snapshots.store")

MANIFESTS = "manifests"


@dataclass
class StoreContext:
    settings: SnapshotSettings
    repository: Repository
    layers: LayerStore
    cache: ImageCache
    # Downloads and packed artifacts in flight (beside the cache: installing is a rename).
    work: Path
    guard: SweepGuard = field(default_factory=SweepGuard)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def lock(self, name: str) -> asyncio.Lock:
        """One lock per artifact (`layer:<digest>`, `image:<id>`): a layer published and
        fetched at once, or fetched twice, is handled once."""
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    def tmp_path(self, name: str) -> Path:
        self.work.mkdir(parents=True, exist_ok=True)
        return self.work / f"{uuid.uuid4().hex[:16]}-{name}"

    async def get(self, snapshot_id: str) -> Manifest:
        check_id(snapshot_id)
        try:
            data = await self.repository.get_bytes(manifest_key(snapshot_id))
        except ObjectNotFound:
            raise SnapshotNotFound(snapshot_id) from None
        m = Manifest.from_json(data, snapshot_id=snapshot_id)
        if m.id != snapshot_id:
            raise ManifestCorrupt(
                f"manifest {manifest_key(snapshot_id)!r} holds snapshot {m.id!r}",
                snapshot_id=snapshot_id,
                artifact="manifest",
            )
        return m

    async def all_manifests(self, *, strict: bool) -> list[Manifest]:
        """Every manifest in the repository. An unreadable one raises when `strict`, else
        it is logged and skipped."""
        objs = await self.repository.list(MANIFESTS)
        ids = [
            o.key[len(MANIFESTS) + 1 : -len(".json")]
            for o in objs
            if o.key.endswith(".json") and "/" not in o.key[len(MANIFESTS) + 1 :]
        ]
        sem = asyncio.Semaphore(16)

        async def one(i: str) -> Manifest | None:
            async with sem:
                try:
                    return await self.get(i)
                except SnapshotNotFound:
                    return None  # deleted meanwhile
                except ArtifactError:
                    if strict:
                        raise
                    log.warning("skipping unreadable manifest of %s", i, exc_info=True)
                    return None

        found = await asyncio.gather(*(one(i) for i in ids))
        return [m for m in found if m is not None]
