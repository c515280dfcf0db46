"""Fetching snapshots: making one usable on this node, verified before it is used.

Each layer is downloaded, its checksum verified *before* unpacking, unpacked beside the layer
store and added atomically; the memory image lands in the bounded image cache
(`cache.ImageCache`) the same way. A missing or corrupt object raises
`ArtifactMissing`/`ArtifactCorrupt` naming the snapshot and the artifact; nothing
half-restored is left behind. A local repository's objects are read in place (no download)
and its raw memory-image files are reflinked or hard-linked into the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

from .artifacts import clone_file, hash_file, unpack_dir, unpack_file
from .context import StoreContext
from .errors import ArtifactCorrupt, ArtifactError, ArtifactMissing, ManifestCorrupt, ObjectNotFound
from .manifest import CheckpointFile, CheckpointRef, LayerRef, Manifest, ObjectRef
from .repos.base import ChecksumMismatch

log = logging.getLogger("aenv.snapshots.store")


class Fetcher:
    def __init__(self, ctx: StoreContext) -> None:
        self.ctx = ctx

    async def fetch(self, snapshot_id: str) -> tuple[Manifest, Path | None]:
        """Makes a snapshot usable on this node: every layer in the local layer store, the
        memory image (if any) in the image cache. Returns the manifest and the image's
        directory (None for a filesystem-only snapshot)."""
        m = await self.ctx.get(snapshot_id)
        if not m.is_complete():
            raise ManifestCorrupt(
                f"manifest of snapshot {snapshot_id!r} lists a layer without an object",
                snapshot_id=snapshot_id,
                artifact="manifest",
            )
        for layer in m.layers:
            await self._fetch_layer(m.id, layer)
        if m.checkpoint is None:
            return m, None
        with self.ctx.cache.hold(m.id):
            path = await self._fetch_checkpoint(m.id, m.checkpoint)
        return m, path

    async def ensure_layers(self, manifest: Manifest) -> None:
        for layer in manifest.layers:
            await self._fetch_layer(manifest.id, layer)

    async def _download_verified(
        self, snapshot_id: str, artifact: str, ref: ObjectRef
    ) -> tuple[Path, bool]:
        """The object as a local file whose checksum matched: the repository's own file
        (read in place, second value False) or a download in the work dir (True: the
        caller deletes it)."""
        missing = ArtifactMissing(
            f"snapshot {snapshot_id!r}: {artifact} is missing from the repository "
            f"(object {ref.key} not found)",
            snapshot_id=snapshot_id,
            artifact=artifact,
        )
        local = self.ctx.repository.local_path(ref.key)
        if local is not None:
            try:
                sha, size = await asyncio.to_thread(hash_file, local)
            except FileNotFoundError:
                raise missing from None
            if sha != ref.sha256 or size != ref.size:
                raise ArtifactCorrupt(
                    f"snapshot {snapshot_id!r}: {artifact} is corrupt: object {ref.key} has "
                    f"sha256:{sha} ({size} bytes), manifest says sha256:{ref.sha256} "
                    f"({ref.size} bytes)",
                    snapshot_id=snapshot_id,
                    artifact=artifact,
                )
            return local, False
        tmp = self.ctx.tmp_path("download")
        try:
            await self.ctx.repository.get_file(ref.key, tmp, sha256=ref.sha256, size=ref.size)
        except ObjectNotFound:
            raise missing from None
        except ChecksumMismatch as e:
            raise ArtifactCorrupt(
                f"snapshot {snapshot_id!r}: {artifact} is corrupt: object {ref.key}: "
                f"expected {e.expected}, got {e.actual}",
                snapshot_id=snapshot_id,
                artifact=artifact,
            ) from None
        return tmp, True

    async def _fetch_layer(self, snapshot_id: str, layer: LayerRef) -> None:
        digest = layer.digest
        artifact = f"layer {digest}"
        async with self.ctx.lock(f"layer:{digest}"):
            if self.ctx.layers.has(digest):
                with contextlib.suppress(OSError):
                    self.ctx.layers.touch(digest)
                return
            assert layer.object is not None
            ref = layer.object
            obj, owned = await self._download_verified(snapshot_id, artifact, ref)
            try:
                await asyncio.to_thread(self._unpack_layer, snapshot_id, digest, obj, ref)
            finally:
                if owned:
                    obj.unlink(missing_ok=True)
            log.info("fetched layer %s of %s (%d bytes)", digest, snapshot_id, ref.size)

    def _unpack_layer(self, snapshot_id: str, digest: str, obj: Path, ref: ObjectRef) -> None:
        with self.ctx.layers.staging() as st:
            rootfs = st / "rootfs"
            try:
                unpack_dir(obj, rootfs, compression=ref.compression)
            except ArtifactError as e:
                raise ArtifactCorrupt(
                    f"snapshot {snapshot_id!r}: layer {digest} does not unpack: {e.message}",
                    snapshot_id=snapshot_id,
                    artifact=f"layer {digest}",
                ) from None
            self.ctx.layers.add_dir(rootfs, digest, mode="move", source=f"snapshot {snapshot_id}")

    async def _fetch_checkpoint(self, snapshot_id: str, ckpt: CheckpointRef) -> Path:
        fp = ckpt.fingerprint()
        async with self.ctx.lock(f"image:{snapshot_id}"):
            hit = self.ctx.cache.lookup(snapshot_id, fp)
            if hit is not None:
                return hit
            t0 = time.monotonic()
            with self.ctx.cache.staging() as st:
                for f in ckpt.files:
                    await self._fetch_checkpoint_file(snapshot_id, f, st)
                path = await asyncio.to_thread(self.ctx.cache.install, snapshot_id, fp, st)
            await asyncio.to_thread(self.ctx.cache.evict, keep=frozenset({snapshot_id}))
            log.info(
                "fetched memory image of %s (%d bytes) in %.2fs",
                snapshot_id,
                ckpt.size,
                time.monotonic() - t0,
            )
            return path

    async def _fetch_checkpoint_file(self, snapshot_id: str, f: CheckpointFile, st: Path) -> None:
        artifact = f"checkpoint file {f.name}"
        obj, owned = await self._download_verified(snapshot_id, artifact, f.object)
        dst = st / f.name
        try:
            if not owned and f.object.compression == "none":
                # A local repository's object: share it (reflink, else hard link).
                await asyncio.to_thread(clone_file, obj, dst, allow_hardlink=True)
            else:
                try:
                    await asyncio.to_thread(
                        unpack_file, obj, dst, compression=f.object.compression, mode=f.mode
                    )
                except ArtifactCorrupt as e:
                    raise ArtifactCorrupt(
                        f"snapshot {snapshot_id!r}: {artifact} does not decompress: {e.message}",
                        snapshot_id=snapshot_id,
                        artifact=artifact,
                    ) from None
        finally:
            if owned:
                obj.unlink(missing_ok=True)
