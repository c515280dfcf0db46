"""Publishing snapshots: upload only what the repository lacks, the manifest last.

Layers are content-addressed and shared between snapshots, so a snapshot costs its new layers
plus its memory image. The manifest is written *last*: a crash mid-publish leaves
unreferenced objects (swept later), never a manifest pointing at missing data. With a local
repository nothing is copied twice: packed layer tars and compressed images are renamed into
the repository, and a memory image given up by the caller seeds the image cache in place.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from ..images.layers import parse_digest, tree_size
from .artifacts import Compression, clone_file, pack_dir, pack_file, suffix
from .context import StoreContext
from .errors import ArtifactError, ArtifactMissing, SnapshotNotFound
from .manifest import CheckpointFile, CheckpointRef, LayerRef, Manifest, ObjectRef, check_id
from .repos.base import ObjectInfo
from .sweeping import IMAGES, LAYERS, sweep

log = logging.getLogger("aenv.snapshots.store")


def layer_prefix(digest: str) -> str:
    algo, hexd = parse_digest(digest)
    return f"{LAYERS}/{algo}-{hexd}"


def _layer_object_ref(o: ObjectInfo) -> ObjectRef | None:
    """An existing `layers/<algo>-<hex>/<sha256>.tar[.zst]` object as a reference."""
    name = o.key.rsplit("/", 1)[-1]
    for ext, comp in ((".tar.zst", "zstd"), (".tar", "none")):
        if name.endswith(ext):
            sha = name[: -len(ext)]
            if len(sha) == 64 and all(c in "0123456789abcdef" for c in sha):
                return ObjectRef(key=o.key, sha256=sha, size=o.size, compression=comp)  # type: ignore[arg-type]
    return None


class Publisher:
    def __init__(self, ctx: StoreContext) -> None:
        self.ctx = ctx
        comp = ctx.settings.snapshot_compression
        self.layer_compression: Compression = "none" if comp == "none" else "zstd"
        if comp == "auto":
            # Local: raw images are hard-linked into the cache (no copy, no decompression).
            # Remote: the network is the bottleneck; zstd -1..3 runs at 250-600 MB/s.
            self.image_compression: Compression = (
                "none" if ctx.repository.local_path_capable else "zstd"
            )
        else:
            self.image_compression = comp

    async def publish(
        self,
        manifest: Manifest,
        layer_dirs: Mapping[str, Path] | None = None,
        checkpoint_dir: Path | None = None,
        *,
        move_checkpoint: bool = False,
    ) -> Manifest:
        """See `SnapshotStore.publish`."""
        m = manifest.model_copy(deep=True)
        check_id(m.id)
        layer_dirs = dict(layer_dirs or {})
        for d in layer_dirs:
            parse_digest(d)
        files = self._checkpoint_files(m.id, checkpoint_dir) if checkpoint_dir else None
        async with self.ctx.guard.publishing():
            try:
                old = await self.ctx.get(m.id)
            except (SnapshotNotFound, ArtifactError):
                old = None
            for layer in m.layers:
                await self._publish_layer(m.id, layer, layer_dirs)
            seed: list[tuple[Path, CheckpointFile]] = []
            if files is not None:
                m.checkpoint, seed = await self._publish_checkpoint(m.id, files, move_checkpoint)
            await self.ctx.repository.put_bytes(m.key, m.to_json())
            await self._verify_published(m, layer_dirs)
        if seed and m.checkpoint is not None:
            await asyncio.to_thread(self._seed_cache, m.id, m.checkpoint, seed)
        if old is not None:
            stale = {o.key for o in old.objects()} - {o.key for o in m.objects()}
            if stale:
                await sweep(self.ctx, stale, grace=self.ctx.settings.snapshot_gc_grace_seconds)
        return m

    def _checkpoint_files(self, snapshot_id: str, d: Path) -> list[Path]:
        d = Path(d)
        if not d.is_dir():
            raise ArtifactError(
                f"checkpoint image {d} of snapshot {snapshot_id!r} is not a directory",
                snapshot_id=snapshot_id,
                artifact="checkpoint",
            )
        out: list[Path] = []
        for entry in sorted(os.scandir(d), key=lambda e: e.name):
            if not entry.is_file(follow_symlinks=False) or entry.name.startswith("."):
                raise ArtifactError(
                    f"checkpoint image {d} of snapshot {snapshot_id!r} holds {entry.name!r}: "
                    "only regular files (not starting with '.') are supported",
                    snapshot_id=snapshot_id,
                    artifact="checkpoint",
                )
            out.append(Path(entry.path))
        return out

    async def _existing_layer_object(self, digest: str) -> ObjectRef | None:
        for o in await self.ctx.repository.list(layer_prefix(digest)):
            ref = _layer_object_ref(o)
            if ref is not None:
                return ref
        return None

    async def _publish_layer(
        self,
        snapshot_id: str,
        layer: LayerRef,
        layer_dirs: Mapping[str, Path],
        *,
        force: bool = False,
    ) -> None:
        digest = layer.digest
        async with self.ctx.lock(f"layer:{digest}"):
            src = layer_dirs.get(digest)
            if src is None and self.ctx.layers.has(digest):
                src = self.ctx.layers.path(digest)
            if layer.size == 0:
                if self.ctx.layers.has(digest):
                    layer.size = self.ctx.layers.size(digest)
                elif src is not None:
                    layer.size = (await asyncio.to_thread(tree_size, Path(src)))[0]
            if not force:
                if layer.object is not None:
                    info = await self.ctx.repository.stat(layer.object.key)
                    if info is not None and info.size == layer.object.size:
                        return
                existing = await self._existing_layer_object(digest)
                if existing is not None:
                    layer.object = existing
                    return
            if src is None:
                raise ArtifactError(
                    f"cannot publish snapshot {snapshot_id!r}: layer {digest} is neither in "
                    "the repository nor on this node",
                    snapshot_id=snapshot_id,
                    artifact=f"layer {digest}",
                )
            tmp = self.ctx.tmp_path("layer.tar")
            try:
                packed = await asyncio.to_thread(
                    pack_dir,
                    Path(src),
                    tmp,
                    compression=self.layer_compression,
                    level=self.ctx.settings.snapshot_zstd_level,
                )
                key = f"{layer_prefix(digest)}/{packed.sha256}.tar{suffix(packed.compression)}"
                await self.ctx.repository.put_file(key, packed.path, move=True)
            finally:
                tmp.unlink(missing_ok=True)
            layer.object = ObjectRef(
                key=key,
                sha256=packed.sha256,
                size=packed.size,
                compression=packed.compression,
                raw_size=packed.raw_size,
            )
            log.info(
                "published layer %s of %s: %d bytes (%d raw)",
                digest,
                snapshot_id,
                packed.size,
                packed.raw_size,
            )

    async def _publish_checkpoint(
        self, snapshot_id: str, files: list[Path], move: bool
    ) -> tuple[CheckpointRef, list[tuple[Path, CheckpointFile]]]:
        """Uploads each file of the image as its own object. Returns the reference and,
        when the caller gave the files up, what can seed the image cache."""
        refs: list[CheckpointFile] = []
        seed: list[tuple[Path, CheckpointFile]] = []
        comp = self.image_compression
        for src in files:
            tmp = self.ctx.tmp_path(src.name + ".zst")
            try:
                packed = await asyncio.to_thread(pack_file, src, tmp, compression=comp, level=1)
                key = f"{IMAGES}/{snapshot_id}/{packed.sha256}/{src.name}{suffix(comp)}"
                mode = src.stat().st_mode & 0o7777
                ref = CheckpointFile(
                    name=src.name,
                    mode=mode,
                    object=ObjectRef(
                        key=key,
                        sha256=packed.sha256,
                        size=packed.size,
                        compression=comp,
                        raw_size=packed.raw_size,
                    ),
                )
                if not await self.ctx.repository.exists(key):
                    if comp == "zstd":
                        await self.ctx.repository.put_file(key, packed.path, move=True)
                    else:
                        # Raw: the object is the file itself. A local repository renames it
                        # in when the caller gave it up; S3 uploads it and we keep it for the
                        # cache.
                        give = move and self.ctx.repository.local_path_capable
                        await self.ctx.repository.put_file(key, src, move=give)
                refs.append(ref)
                if move:
                    seed.append((src, ref))
            finally:
                tmp.unlink(missing_ok=True)
        return CheckpointRef(files=refs), seed

    def adopt_image(self, manifest: Manifest, image_dir: Path) -> None:
        """Puts a local copy of a published snapshot's memory image into the image cache
        (moved, or linked to a local repository's objects), as if it had been fetched. The
        caller gives `image_dir` up. Sync."""
        if manifest.checkpoint is None:
            return
        seed = [(Path(image_dir) / f.name, f) for f in manifest.checkpoint.files]
        self._seed_cache(manifest.id, manifest.checkpoint, seed)

    def _seed_cache(
        self,
        snapshot_id: str,
        ckpt: CheckpointRef,
        seed: list[tuple[Path, CheckpointFile]],
    ) -> None:
        """Puts the image just published into the cache without fetching it back."""
        fp = ckpt.fingerprint()
        if self.ctx.cache.lookup(snapshot_id, fp) is not None:
            return
        try:
            with self.ctx.cache.staging() as st:
                for src, ref in seed:
                    dst = st / ref.name
                    local = self.ctx.repository.local_path(ref.object.key)
                    if local is not None and ref.object.compression == "none":
                        clone_file(local, dst, allow_hardlink=True)
                    elif src.exists():
                        try:
                            os.rename(src, dst)
                        except OSError:
                            clone_file(src, dst, allow_hardlink=False)
                    else:
                        return  # nothing to seed from: a later fetch downloads it
                self.ctx.cache.install(snapshot_id, fp, st)
            self.ctx.cache.evict(keep=frozenset({snapshot_id}))
        except OSError:
            log.warning("could not seed the image cache with %s", snapshot_id, exc_info=True)

    async def _verify_published(self, m: Manifest, layer_dirs: Mapping[str, Path]) -> None:
        """After the manifest is written: every object must be there. Another node's sweep
        may have removed a layer object we chose to reuse in the meantime; upload such a
        layer again (once) and rewrite the manifest."""
        missing = [
            layer
            for layer in m.layers
            if layer.object is not None and not await self.ctx.repository.exists(layer.object.key)
        ]
        if m.checkpoint is not None:
            for f in m.checkpoint.files:
                if not await self.ctx.repository.exists(f.object.key):
                    raise ArtifactMissing(
                        f"snapshot {m.id!r}: checkpoint file {f.name!r} vanished from the "
                        f"repository while publishing ({f.object.key})",
                        snapshot_id=m.id,
                        artifact=f"checkpoint {f.name}",
                    )
        if not missing:
            return
        for layer in missing:
            await self._publish_layer(m.id, layer, layer_dirs, force=True)
        await self.ctx.repository.put_bytes(m.key, m.to_json())
