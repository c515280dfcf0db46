"""The default template `base`: the Debian rootfs of `base_rootfs.py` as a one-layer template.

`build_base(settings)` makes sure template `base` exists in `settings`' catalog with its
layer in the layer store. Every `$AENV_HOME` imports the machine-wide cached rootfs with hard
links (`cp -al`), which takes well under a second: layers are read-only, so sharing inodes
with the cache is safe, and deleting the cache does not affect imported layers.

It knows nothing about the CLI: it reports progress through an optional callback
`progress(stage, detail)`, which `aenv template build-base` renders with rich.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..config import Settings
from ..domain import BuildInfo, TemplateKind, TemplateRecord
from ..fsutil import flock
from ..images.layers import LayerStore
from ..orchestrator.catalog import Catalog
from ..runtime.storage.cowpool import open_pool
from .base_rootfs import (
    PATH,
    SUITE,
    USER_NAME,
    VARIANT,
    BaseBuildError,
    ProgressFn,
    cache_root,
    ensure_cached_rootfs,
    recipe_hash,
)

TEMPLATE_ID = "base"
TEMPLATE_NAME = "base"


def template_record(
    settings: Settings, layers: list[str], cache_meta: dict[str, Any]
) -> TemplateRecord:
    """Template `base` as the catalog keeps it; what only this builder reads (where the
    rootfs came from, its recipe and size) is in its `build`."""
    return TemplateRecord(
        template_id=TEMPLATE_ID,
        names=[TEMPLATE_NAME],
        kind=TemplateKind.IMAGE,
        layers=layers,  # topmost first
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        env={"PATH": PATH, "LANG": "C.UTF-8"},
        workdir=f"/home/{USER_NAME}",
        user=USER_NAME,
        cpu_count=settings.default_cpu_count,
        memory_mb=settings.default_memory_mb,
        build=BuildInfo(
            source=f"debootstrap {VARIANT} {SUITE}",
            recipe_hash=str(cache_meta.get("recipe_hash", recipe_hash())),
            size=None if cache_meta.get("size") is None else int(cache_meta["size"]),
        ),
    )


def base_is_current(settings: Settings, catalog: Catalog | None = None) -> list[str] | None:
    """The layers of template `base` if it is registered, its layers exist and it was built
    from the current recipe; None otherwise. Cheap (one SQLite read, a few stats)."""
    if not settings.catalog_path.exists():
        return None
    own = catalog is None
    cat = catalog or Catalog(settings.catalog_path)
    try:
        rec = cat.template(TEMPLATE_ID)
    finally:
        if own:
            cat.close()
    if rec is None or not rec.layers or rec.build.recipe_hash != recipe_hash():
        return None
    store = LayerStore(settings)
    if not all(store.has(d) for d in rec.layers):
        return None
    return list(rec.layers)


def build_base(
    settings: Settings,
    *,
    force: bool = False,
    progress: ProgressFn | None = None,
    cache_dir: Path | None = None,
) -> list[str]:
    """Makes sure template `base` exists; returns its layer digests (topmost first).

    Idempotent: when `base` is registered from the current recipe and its layers are in the
    store, returns at once. Otherwise imports the machine-wide cached rootfs (building it
    with debootstrap first when missing) into the layer store and registers the template.
    `force` rebuilds everything, debootstrap included (downloaded .debs stay cached).
    """
    if os.geteuid() == 0:
        open_pool(settings)  # the node's btrfs pool may hold layers/: mounted first
    if not force:
        layers = base_is_current(settings)
        if layers:
            if progress:
                progress("done", "template base is up to date")
            return layers
    if os.geteuid() != 0:
        raise BaseBuildError("building the base template needs root (debootstrap, chroot)")
    settings.home.mkdir(parents=True, exist_ok=True)
    store = LayerStore(settings)
    store.root.mkdir(parents=True, exist_ok=True)
    with flock(store.root / ".base.lock"):
        if not force:
            layers = base_is_current(settings)
            if layers:
                return layers
        if progress:
            progress("cache", f"machine cache {cache_dir or cache_root()}")
        rootfs, meta = ensure_cached_rootfs(
            settings, force=force, progress=progress, cache_dir=cache_dir
        )
        if progress:
            progress("import", f"{meta['digest']} into {store.root}")
        digest = store.add_dir(
            rootfs,
            digest=meta["digest"],
            mode="link",
            source=f"debootstrap {VARIANT} {SUITE} (recipe {meta.get('recipe_hash', '?')})",
        )
        layers = [digest]
        catalog = Catalog(settings.catalog_path)
        try:
            catalog.put_template(template_record(settings, layers, meta))
        finally:
            catalog.close()
        if progress:
            progress("done", f"template base = {digest}")
        return layers
