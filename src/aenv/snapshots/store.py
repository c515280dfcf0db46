"""`SnapshotStore`: publishing snapshots to the repository and fetching them onto this node.

- **publish** uploads only what the repository lacks (layers are content-addressed and
  shared between snapshots, so a snapshot costs its new layers plus its memory image), then
  writes the manifest *last*: a crash mid-publish leaves unreferenced objects (swept later),
  never a manifest pointing at missing data.
- **fetch** makes a snapshot usable here: each layer is downloaded, its checksum verified
  *before* unpacking, unpacked beside the layer store and added atomically; the memory image
  lands in the bounded image cache (`cache.ImageCache`) the same way. A missing or corrupt
  object raises `ArtifactMissing`/`ArtifactCorrupt` naming the snapshot and the artifact;
  nothing half-restored is left behind.
- **delete** removes the manifest, then sweeps objects that no remaining manifest references
  (mark and sweep over all manifests).

With a local repository nothing is copied twice: packed layer tars and compressed images are
renamed into the repository, objects are read in place (no download), and memory-image
files are reflinked or hard-linked into the cache (objects are immutable and read-only).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path

from ..config import Settings
from ..images.layers import LayerStore, parse_digest, tree_size
from .artifacts import (
    Compression,
    clone_file,
    hash_file,
    pack_dir,
    pack_file,
    rmtree,
    suffix,
    unpack_dir,
    unpack_file,
)
from .cache import ImageCache
from .config import SnapshotSettings
from .errors import (
    ArtifactCorrupt,
    ArtifactError,
    ArtifactMissing,
    ManifestCorrupt,
    ObjectNotFound,
    SnapshotNotFound,
)
from .manifest import (
    CheckpointFile,
    CheckpointRef,
    LayerRef,
    Manifest,
    ObjectRef,
    check_id,
    manifest_key,
)
from .repos.base import ChecksumMismatch, ObjectInfo, Repository

log = logging.getLogger(__name__)

_MANIFESTS = "manifests"
_LAYERS = "layers"
_IMAGES = "images"


def layer_prefix(digest: str) -> str:
    algo, hexd = parse_digest(digest)
    return f"{_LAYERS}/{algo}-{hexd}"


def _layer_object_ref(o: ObjectInfo) -> ObjectRef | None:
    """An existing `layers/<algo>-<hex>/<sha256>.tar[.zst]` object as a reference."""
    name = o.key.rsplit("/", 1)[-1]
    for ext, comp in ((".tar.zst", "zstd"), (".tar", "none")):
        if name.endswith(ext):
            sha = name[: -len(ext)]
            if len(sha) == 64 and all(c in "0123456789abcdef" for c in sha):
                return ObjectRef(key=o.key, sha256=sha, size=o.size, compression=comp)  # type: ignore[arg-type]
    return None


class _SweepGuard:
    """Many publishes at once, or one sweep alone (in this process): a sweep must not delete
    an object a concurrent publish just decided to reuse."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._publishing = 0
        self._sweeping = False

    @contextlib.asynccontextmanager
    async def publishing(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._sweeping)
            self._publishing += 1
        try:
            yield
        finally:
            async with self._cond:
                self._publishing -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def sweeping(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._sweeping and self._publishing == 0)
            self._sweeping = True
        try:
            yield
        finally:
            async with self._cond:
                self._sweeping = False
                self._cond.notify_all()


class SnapshotStore:
    def __init__(
        self,
        settings: Settings,
        repository: Repository,
        layer_store: LayerStore | None = None,
        *,
        snapshot_settings: SnapshotSettings | None = None,
        cache_size: int | None = None,
    ) -> None:
        self.settings = settings
        self.snap = snapshot_settings or SnapshotSettings()
        self.repository = repository
        self.layers = layer_store or LayerStore(settings)
        cache_root = settings.home / "cache"
        self.work = cache_root / "tmp"
        self.cache = ImageCache(
            cache_root / "images",
            int(self.snap.snapshot_cache_size) if cache_size is None else cache_size,
            tmp=self.work,
        )
        comp = self.snap.snapshot_compression
        self.layer_compression: Compression = "none" if comp == "none" else "zstd"
        if comp == "auto":
            # Local: raw images are hard-linked into the cache (no copy, no decompression).
            # Remote: the network is the bottleneck; zstd -1..3 runs at 250-600 MB/s.
            self.image_compression: Compression = (
                "none" if repository.local_path_capable else "zstd"
            )
        else:
            self.image_compression = comp
        self._locks: dict[str, asyncio.Lock] = {}
        self._guard = _SweepGuard()

    # --- small helpers ---
    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    def _tmp_path(self, name: str) -> Path:
        self.work.mkdir(parents=True, exist_ok=True)
        return self.work / f"{uuid.uuid4().hex[:16]}-{name}"

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

    async def exists(self, snapshot_id: str) -> bool:
        return await self.repository.exists(manifest_key(snapshot_id))

    async def _all_manifests(self, *, strict: bool) -> builtins.list[Manifest]:
        objs = await self.repository.list(_MANIFESTS)
        ids = [
            o.key[len(_MANIFESTS) + 1 : -len(".json")]
            for o in objs
            if o.key.endswith(".json") and "/" not in o.key[len(_MANIFESTS) + 1 :]
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

    async def list(self, kind: str | None = None) -> builtins.list[Manifest]:
        """All manifests (oldest first), optionally of one kind. Unreadable ones are logged
        and skipped."""
        ms = await self._all_manifests(strict=False)
        if kind is not None:
            ms = [m for m in ms if m.kind == kind]
        ms.sort(key=lambda m: (m.created_at, m.id))
        return ms

    # --- publishing ---
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
        m = manifest.model_copy(deep=True)
        check_id(m.id)
        layer_dirs = dict(layer_dirs or {})
        for d in layer_dirs:
            parse_digest(d)
        files = self._checkpoint_files(m.id, checkpoint_dir) if checkpoint_dir else None
        async with self._guard.publishing():
            try:
                old = await self.get(m.id)
            except (SnapshotNotFound, ArtifactError):
                old = None
            for layer in m.layers:
                await self._publish_layer(m.id, layer, layer_dirs)
            seed: builtins.list[tuple[Path, CheckpointFile]] = []
            if files is not None:
                m.checkpoint, seed = await self._publish_checkpoint(m.id, files, move_checkpoint)
            await self.repository.put_bytes(m.key, m.to_json())
            await self._verify_published(m, layer_dirs)
        if seed and m.checkpoint is not None:
            await asyncio.to_thread(self._seed_cache, m.id, m.checkpoint, seed)
        if old is not None:
            stale = {o.key for o in old.objects()} - {o.key for o in m.objects()}
            if stale:
                await self._sweep(stale, grace=self.snap.snapshot_gc_grace_seconds)
        return m

    def _checkpoint_files(self, snapshot_id: str, d: Path) -> builtins.list[Path]:
        d = Path(d)
        if not d.is_dir():
            raise ArtifactError(
                f"checkpoint image {d} of snapshot {snapshot_id!r} is not a directory",
                snapshot_id=snapshot_id,
                artifact="checkpoint",
            )
        out: builtins.list[Path] = []
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
        for o in await self.repository.list(layer_prefix(digest)):
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
        async with self._lock(f"layer:{digest}"):
            src = layer_dirs.get(digest)
            if src is None and self.layers.has(digest):
                src = self.layers.path(digest)
            if layer.size == 0:
                if self.layers.has(digest):
                    layer.size = self.layers.size(digest)
                elif src is not None:
                    layer.size = (await asyncio.to_thread(tree_size, Path(src)))[0]
            if not force:
                if layer.object is not None:
                    info = await self.repository.stat(layer.object.key)
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
            tmp = self._tmp_path("layer.tar")
            try:
                packed = await asyncio.to_thread(
                    pack_dir,
                    Path(src),
                    tmp,
                    compression=self.layer_compression,
                    level=self.snap.snapshot_zstd_level,
                )
                key = f"{layer_prefix(digest)}/{packed.sha256}.tar{suffix(packed.compression)}"
                await self.repository.put_file(key, packed.path, move=True)
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
        self, snapshot_id: str, files: builtins.list[Path], move: bool
    ) -> tuple[CheckpointRef, builtins.list[tuple[Path, CheckpointFile]]]:
        """Uploads each file of the image as its own object. Returns the reference and,
        when the caller gave the files up, what can seed the image cache."""
        refs: builtins.list[CheckpointFile] = []
        seed: builtins.list[tuple[Path, CheckpointFile]] = []
        comp = self.image_compression
        for src in files:
            tmp = self._tmp_path(src.name + ".zst")
            try:
                packed = await asyncio.to_thread(pack_file, src, tmp, compression=comp, level=1)
                key = f"{_IMAGES}/{snapshot_id}/{packed.sha256}/{src.name}{suffix(comp)}"
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
                if not await self.repository.exists(key):
                    if comp == "zstd":
                        await self.repository.put_file(key, packed.path, move=True)
                    else:
                        # Raw: the object is the file itself. A local repository renames it
                        # in when the caller gave it up; S3 uploads it and we keep it for the
                        # cache.
                        give = move and self.repository.local_path_capable
                        await self.repository.put_file(key, src, move=give)
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
        seed: builtins.list[tuple[Path, CheckpointFile]],
    ) -> None:
        """Puts the image just published into the cache without fetching it back."""
        fp = ckpt.fingerprint()
        if self.cache.lookup(snapshot_id, fp) is not None:
            return
        try:
            with self.cache.staging() as st:
                for src, ref in seed:
                    dst = st / ref.name
                    local = self.repository.local_path(ref.object.key)
                    if local is not None and ref.object.compression == "none":
                        clone_file(local, dst, allow_hardlink=True)
                    elif src.exists():
                        try:
                            os.rename(src, dst)
                        except OSError:
                            clone_file(src, dst, allow_hardlink=False)
                    else:
                        return  # nothing to seed from: a later fetch downloads it
                self.cache.install(snapshot_id, fp, st)
            self.cache.evict(keep=frozenset({snapshot_id}))
        except OSError:
            log.warning("could not seed the image cache with %s", snapshot_id, exc_info=True)

    async def _verify_published(self, m: Manifest, layer_dirs: Mapping[str, Path]) -> None:
        """After the manifest is written: every object must be there. Another node's sweep
        may have removed a layer object we chose to reuse in the meantime; upload such a
        layer again (once) and rewrite the manifest."""
        missing = [
            layer
            for layer in m.layers
            if layer.object is not None and not await self.repository.exists(layer.object.key)
        ]
        if m.checkpoint is not None:
            for f in m.checkpoint.files:
                if not await self.repository.exists(f.object.key):
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
        await self.repository.put_bytes(m.key, m.to_json())

    # --- fetching ---
    async def fetch(self, snapshot_id: str) -> tuple[Manifest, Path | None]:
        """Makes a snapshot usable on this node: every layer in the local layer store, the
        memory image (if any) in the image cache. Returns the manifest and the image's
        directory (None for a filesystem-only snapshot)."""
        m = await self.get(snapshot_id)
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
        with self.cache.hold(m.id):
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
        local = self.repository.local_path(ref.key)
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
        tmp = self._tmp_path("download")
        try:
            await self.repository.get_file(ref.key, tmp, sha256=ref.sha256, size=ref.size)
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
        async with self._lock(f"layer:{digest}"):
            if self.layers.has(digest):
                with contextlib.suppress(OSError):
                    self.layers.touch(digest)
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
        with self.layers.staging() as st:
            rootfs = st / "rootfs"
            try:
                unpack_dir(obj, rootfs, compression=ref.compression)
            except ArtifactError as e:
                raise ArtifactCorrupt(
                    f"snapshot {snapshot_id!r}: layer {digest} does not unpack: {e.message}",
                    snapshot_id=snapshot_id,
                    artifact=f"layer {digest}",
                ) from None
            self.layers.add_dir(rootfs, digest, mode="move", source=f"snapshot {snapshot_id}")

    async def _fetch_checkpoint(self, snapshot_id: str, ckpt: CheckpointRef) -> Path:
        fp = ckpt.fingerprint()
        async with self._lock(f"image:{snapshot_id}"):
            hit = self.cache.lookup(snapshot_id, fp)
            if hit is not None:
                return hit
            t0 = time.monotonic()
            with self.cache.staging() as st:
                for f in ckpt.files:
                    await self._fetch_checkpoint_file(snapshot_id, f, st)
                path = await asyncio.to_thread(self.cache.install, snapshot_id, fp, st)
            await asyncio.to_thread(self.cache.evict, keep=frozenset({snapshot_id}))
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

    # --- deleting ---
    async def delete(self, snapshot_id: str) -> None:
        """Deletes the manifest, then every object no remaining manifest references."""
        m = await self.get(snapshot_id)
        await self.repository.delete(m.key)
        await self._sweep({o.key for o in m.objects()}, grace=self.snap.snapshot_gc_grace_seconds)
        self.cache.remove(snapshot_id)

    async def gc(self, grace: float | None = None) -> builtins.list[str]:
        """Removes objects no manifest references that are older than `grace` seconds
        (leftovers of crashed publishes). Returns the deleted keys."""
        g = self.snap.snapshot_gc_grace_seconds if grace is None else grace
        return await self._sweep(set(), grace=g)

    async def _sweep(self, candidates: set[str], *, grace: float) -> builtins.list[str]:
        async with self._guard.sweeping():
            try:
                manifests = await self._all_manifests(strict=True)
            except ArtifactError as e:
                log.error("not sweeping the repository: a manifest is unreadable: %s", e)
                return []
            referenced = {o.key for m in manifests for o in m.objects()}
            now = time.time()
            doomed: builtins.list[str] = []
            for prefix in (_LAYERS, _IMAGES):
                for o in await self.repository.list(prefix):
                    if o.key in referenced:
                        continue
                    if o.key in candidates or now - o.last_modified >= grace:
                        doomed.append(o.key)
            for key in doomed:
                await self.repository.delete(key)
            if doomed:
                log.info("swept %d unreferenced objects", len(doomed))
            return doomed

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
