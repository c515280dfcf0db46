"""Pulling an image from a registry into the layer store.

`pull(settings, store, "python:3.12")` resolves the reference (search registries, allowlist),
picks the platform's manifest, fetches and checks the image config, then for every layer not
yet in the store streams the blob from the registry straight into an unpacked layer
directory (download, digest, decompression and extraction in one pass; see `unpack`),
`pull_concurrency` layers at a time. A layer's store digest is its blob digest (what the
manifest names); its meta.json also records the diff_id, which is checked against the
config's `rootfs.diff_ids`.

Interrupted downloads are resumable: the compressed bytes received so far are kept in
`layers/.partial/<algo>-<hex>` until the layer is in the store, and the next attempt replays
them into the unpacker and asks the registry only for the rest (`Range`).

The layers are pinned in the `LayerCache` for the duration of the pull (and for `holder`
afterwards, when given), and the cache bound is enforced at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

from ..config import ImageSettings
from ..errors import AenvError, BadGateway, BadRequest, NotFound
from .auth import Credential
from .cache import LayerCache
from .layers import LayerStore
from .manifests import (
    DOCKER_CONFIG,
    OCI_CONFIG,
    Descriptor,
    DigestMismatch,
    Platform,
    ResolvedImage,
)
from .pipe import BlobPipe, run_in_thread
from .reference import Reference, candidates, check_allowed
from .registry import RegistryClient
from .streams import InvalidLayer
from .unpack import UnpackResult, unpack_layer

log = logging.getLogger("aenv.images")

LayerStatus = Literal["waiting", "present", "downloading", "done"]


@dataclass(frozen=True)
class LayerProgress:
    digest: str
    done: int  # compressed bytes received (or replayed from a partial download)
    total: int  # compressed size from the manifest
    status: LayerStatus


ProgressFn = Callable[[LayerProgress], None]


@dataclass(frozen=True)
class ImageConfig:
    """What of the image config a sandbox honours (OCI `config` object)."""

    env: list[str] = field(default_factory=list)
    workdir: str = ""
    user: str = ""
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    exposed_ports: list[str] = field(default_factory=list)
    stop_signal: str | None = None

    @classmethod
    def from_image_config(cls, doc: Mapping[str, Any]) -> ImageConfig:
        cfg = doc.get("config") or {}
        if not isinstance(cfg, Mapping):
            cfg = {}

        def strings(value: Any) -> list[str]:
            if isinstance(value, str):
                return [value]
            return [str(v) for v in value] if isinstance(value, list) else []

        return cls(
            env=strings(cfg.get("Env")),
            workdir=str(cfg.get("WorkingDir") or ""),
            user=str(cfg.get("User") or ""),
            entrypoint=strings(cfg.get("Entrypoint")),
            cmd=strings(cfg.get("Cmd")),
            labels={str(k): str(v) for k, v in (cfg.get("Labels") or {}).items()},
            exposed_ports=sorted(str(p) for p in (cfg.get("ExposedPorts") or {})),
            stop_signal=str(cfg["StopSignal"]) if cfg.get("StopSignal") else None,
        )

    def env_dict(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for item in self.env:
            key, _, value = item.partition("=")
            out[key] = value
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "env": list(self.env),
            "workdir": self.workdir,
            "user": self.user,
            "entrypoint": list(self.entrypoint),
            "cmd": list(self.cmd),
            "labels": dict(self.labels),
            "exposed_ports": list(self.exposed_ports),
            "stop_signal": self.stop_signal,
        }


@dataclass(frozen=True)
class PulledImage:
    reference: str  # canonical: registry/repository[:tag][@digest]
    digest: str  # what the reference resolved to (the index digest for multi-platform)
    manifest_digest: str  # the platform's image manifest
    config_digest: str
    platform: str  # os/arch[/variant] of the image config
    layers: list[str]  # store digests (blob digests), topmost first
    diff_ids: list[str]  # topmost first
    config: ImageConfig
    size: int  # compressed bytes of all layers

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "digest": self.digest,
            "manifest_digest": self.manifest_digest,
            "config_digest": self.config_digest,
            "platform": self.platform,
            "layers": list(self.layers),
            "diff_ids": list(self.diff_ids),
            "config": self.config.to_json(),
            "size": self.size,
        }


_LAYER_TYPES_REFUSED = ("foreign", "nondistributable")


def _check_layer_type(desc: Descriptor, ref: Reference) -> None:
    mt = desc.media_type.lower()
    if any(word in mt for word in _LAYER_TYPES_REFUSED):
        raise BadRequest(
            f"image {ref.familiar} has a layer of type {desc.media_type} (foreign layers "
            "are not pulled)",
            error_code="unsupported_layer",
        )
    if mt and "rootfs" not in mt and "image.layer" not in mt:
        raise BadRequest(
            f"{ref.familiar} is not a container image (layer type {desc.media_type})",
            error_code="unsupported_layer",
        )


async def resolve_image(
    client: RegistryClient,
    ref: str | Reference,
    settings: ImageSettings,
    platform: Platform | None = None,
) -> ResolvedImage:
    """Resolves a reference on the first search registry that has it."""
    if isinstance(ref, Reference):
        check_allowed(ref, settings)
        refs = [ref]
    else:
        refs = candidates(ref, settings)
    errors: list[AenvError] = []
    for cand in refs:
        try:
            return await client.resolve(cand, platform)
        except AenvError as e:
            if len(refs) == 1:
                raise
            errors.append(e)
            log.info("%s: %s", cand, e.message)
    if all(isinstance(e, NotFound) for e in errors):
        raise NotFound(
            f"image {ref} not found in any search registry: "
            + "; ".join(e.message for e in errors),
            error_code="image_not_found",
        )
    raise next(e for e in errors if not isinstance(e, NotFound))


def _parse_config(raw: bytes, ref: Reference, n_layers: int) -> tuple[dict[str, Any], list[str]]:
    try:
        doc = json.loads(raw)
    except ValueError:
        raise BadGateway(f"image config of {ref.familiar} is not JSON") from None
    if not isinstance(doc, dict):
        raise BadGateway(f"image config of {ref.familiar} is not a JSON object")
    rootfs = doc.get("rootfs") or {}
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or len(diff_ids) != n_layers:
        raise BadGateway(
            f"image config of {ref.familiar} lists {len(diff_ids or [])} diff_ids for "
            f"{n_layers} layers"
        )
    return doc, [str(d) for d in diff_ids]


# Downloads in flight in this process, so that concurrent pulls share one.
_inflight: dict[tuple[int, str, str], asyncio.Future[None]] = {}


async def pull(
    settings: ImageSettings,
    layer_store: LayerStore,
    ref: str | Reference,
    *,
    progress: ProgressFn | None = None,
    platform: str | Platform | None = None,
    cache: LayerCache | None = None,
    holder: str | None = None,
    credentials: Mapping[str, str | tuple[str, str] | Credential] | None = None,
    client: RegistryClient | None = None,
) -> PulledImage:
    """Pulls `ref` into `layer_store`; layers already there are not downloaded again.

    `holder`: keep a reference on the image's layers for it (e.g. `template:<id>`), taken
    before any download, so they cannot be evicted between the pull and their use."""
    plat = Platform.parse(platform) if isinstance(platform, str) else platform
    cache = cache or LayerCache(layer_store)
    own_client = client is None
    client = client or RegistryClient(settings, credentials=credentials)
    pin = f"pull:{os.getpid()}:{uuid.uuid4().hex[:12]}"
    try:
        resolved = await resolve_image(client, ref, settings, plat)
        cref = resolved.reference
        manifest = resolved.manifest
        config_desc = manifest.config
        if config_desc.media_type not in (DOCKER_CONFIG, OCI_CONFIG, ""):
            raise BadRequest(
                f"{cref.familiar} is not a container image (config type {config_desc.media_type})",
                error_code="unsupported_manifest",
            )
        layers = manifest.layers
        for desc in layers:
            _check_layer_type(desc, cref)
        raw_config = await client.get_blob(cref, config_desc)
        doc, diff_ids = _parse_config(raw_config, cref, len(layers))
        config = ImageConfig.from_image_config(doc)

        digests = [d.digest for d in layers]
        await asyncio.to_thread(cache.ref_many, digests, pin)
        if holder:
            await asyncio.to_thread(cache.ref_many, digests, holder)

        report = progress or (lambda _p: None)
        for desc in layers:
            report(LayerProgress(desc.digest, 0, desc.size, "waiting"))
        sem = asyncio.Semaphore(max(1, settings.pull_concurrency))

        async def one(desc: Descriptor, diff_id: str) -> None:
            await _ensure_layer(client, cref, desc, diff_id, layer_store, report, sem)

        tasks = [
            asyncio.create_task(one(desc, diff_id))
            for desc, diff_id in zip(layers, diff_ids, strict=True)
        ]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

        for d in digests:
            cache.touch(d)
        await asyncio.to_thread(cache.enforce, settings)

        os_ = str(doc.get("os") or "")
        arch = str(doc.get("architecture") or "")
        variant = doc.get("variant")
        image_platform = f"{os_}/{arch}" + (f"/{variant}" if variant else "")
        return PulledImage(
            reference=str(cref),
            digest=resolved.digest,
            manifest_digest=manifest.digest,
            config_digest=config_desc.digest,
            platform=image_platform,
            layers=list(reversed(digests)),
            diff_ids=list(reversed(diff_ids)),
            config=config,
            size=sum(d.size for d in layers),
        )
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(cache.release, pin)
        if own_client:
            await client.aclose()


async def _ensure_layer(
    client: RegistryClient,
    ref: Reference,
    desc: Descriptor,
    diff_id: str,
    store: LayerStore,
    report: ProgressFn,
    sem: asyncio.Semaphore,
) -> None:
    if store.has(desc.digest):
        report(LayerProgress(desc.digest, desc.size, desc.size, "present"))
        return
    key = (id(asyncio.get_running_loop()), str(store.root), desc.digest)
    running = _inflight.get(key)
    if running is not None:
        await asyncio.shield(running)
        report(LayerProgress(desc.digest, desc.size, desc.size, "present"))
        return
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    _inflight[key] = fut
    try:
        async with sem:
            await fetch_layer(client, ref, desc, diff_id, store, report)
    except BaseException as e:
        fut.set_exception(e)
        fut.exception()  # retrieved: no "never retrieved" warning when nobody waits
        raise
    else:
        fut.set_result(None)
    finally:
        _inflight.pop(key, None)


@contextlib.asynccontextmanager
async def _file_lock(path: Path) -> AsyncIterator[None]:
    """An exclusive flock on `path` (other processes pulling the same blob wait). The lock
    file is removed on release; a waiter that got the lock on a removed file retries."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(0.1)
            try:
                current = os.stat(path)
            except FileNotFoundError:
                continue
            if current.st_ino != os.fstat(fd).st_ino:
                continue
            try:
                yield
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            return
        finally:
            os.close(fd)


class _Limited:
    def __init__(self, f: BinaryIO, limit: int) -> None:
        self._f = f
        self._left = limit

    def read(self, n: int = -1, /) -> bytes:
        if self._left <= 0:
            return b""
        if n is None or n < 0 or n > self._left:
            n = self._left
        data = self._f.read(n)
        self._left -= len(data)
        return data


async def fetch_layer(
    client: RegistryClient,
    ref: Reference,
    desc: Descriptor,
    diff_id: str | None,
    store: LayerStore,
    report: ProgressFn | None = None,
) -> UnpackResult | None:
    """Downloads, verifies and unpacks one layer blob into the store (one pass), resuming
    a partial download if one is there. Returns None if the layer appeared meanwhile."""
    report = report or (lambda _p: None)
    algo, _, hexd = desc.digest.partition(":")
    partial_dir = store.root / ".partial"
    partial_dir.mkdir(parents=True, exist_ok=True)
    partial = partial_dir / f"{algo}-{hexd}"
    async with _file_lock(partial_dir / f"{algo}-{hexd}.lock"):
        if store.has(desc.digest):
            report(LayerProgress(desc.digest, desc.size, desc.size, "present"))
            return None
        offset = partial.stat().st_size if partial.exists() else 0
        if offset > desc.size:
            partial.unlink()
            offset = 0
        what = f"layer {desc.digest} of image {ref.familiar} from registry {ref.registry}"
        with store.staging() as stage:
            rootfs = stage / "rootfs"
            try:
                result = await _stream_into(
                    client, ref, desc, diff_id, partial, offset, rootfs, report
                )
            except DigestMismatch as e:
                partial.unlink(missing_ok=True)
                raise DigestMismatch(
                    f"{what} failed verification: {e.message}", error_code=e.error_code
                ) from e
            except InvalidLayer as e:
                partial.unlink(missing_ok=True)
                raise InvalidLayer(f"{what}: {e.message}", error_code=e.error_code) from e
            await asyncio.to_thread(
                store.add_dir,
                rootfs,
                desc.digest,
                mode="move",
                source=str(ref),
                extra={
                    "media_type": desc.media_type,
                    "diff_id": result.diff_id,
                    "compressed_size": result.compressed_size,
                    "tar_size": result.tar_size,
                    "compression": result.compression,
                    "skipped": result.stats.skipped[:100],
                },
            )
            partial.unlink(missing_ok=True)
    report(LayerProgress(desc.digest, desc.size, desc.size, "done"))
    return result


async def _stream_into(
    client: RegistryClient,
    ref: Reference,
    desc: Descriptor,
    diff_id: str | None,
    partial: Path,
    offset: int,
    rootfs: Path,
    report: ProgressFn,
) -> UnpackResult:
    pipe = BlobPipe()
    with contextlib.ExitStack() as files:
        replay = _Limited(files.enter_context(partial.open("rb")), offset) if offset else None
        tee = files.enter_context(partial.open("ab"))

        def consume() -> UnpackResult:
            try:
                return unpack_layer(
                    pipe,
                    rootfs,
                    media_type=desc.media_type,
                    digest=desc.digest,
                    size=desc.size,
                    diff_id=diff_id,
                    replay=replay,
                    tee=tee,
                )
            except BaseException:
                pipe.abort()
                raise
            finally:
                tee.flush()

        consumer = run_in_thread(consume)
        done = offset
        report(LayerProgress(desc.digest, done, desc.size, "downloading"))
        try:
            async for chunk in client.iter_blob(ref, desc, offset):
                if not await pipe.put(chunk):
                    break  # the unpacker failed; its error is raised below
                done += len(chunk)
                report(LayerProgress(desc.digest, done, desc.size, "downloading"))
        except BaseException as e:
            pipe.close(e)
            await asyncio.wait([consumer])
            inner = None if consumer.cancelled() else consumer.exception()
            if isinstance(inner, DigestMismatch):
                raise inner from e
            raise
        pipe.close()
        return await consumer
