"""Template `code-interpreter-v1`: base + Debian's Jupyter packages + the interpreter server
(`aenv.codeinterp`) running on port 49999, for the stock `e2b-code-interpreter` SDK.

Two parts, like E2B's own template (files, then a start command snapshotted with memory):

* on this machine (root, the node's `$AENV_HOME`, like `build_base`): the rootfs template
  `code-interpreter-v1-rootfs` (internal) = [server code layer, packages layer
  (`ci_rootfs.py`), base's layer];
* on the server (the E2B build API): a build of `code-interpreter-v1` from it whose start
  command is the interpreter server and whose ready command asks its `/health`, so the
  template is a memory snapshot with the server and a warm python kernel running — every
  sandbox created from it (and its pauses, snapshots and fork children) has them.

`aenv template build-code-interpreter` runs both; it skips what is up to date.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..config import Settings
from ..domain import BuildInfo, TemplateKind, TemplateRecord
from ..fsutil import flock
from ..images.layers import LayerStore, tree_digest
from ..orchestrator.catalog import Catalog
from . import base as base_template
from .base_rootfs import PATH, USER_NAME, BaseBuildError, ProgressFn
from .ci_rootfs import ensure_cached_layer

TEMPLATE_NAME = "code-interpreter-v1"
ROOTFS_ID = "code-interpreter-v1-rootfs"
PORT = 49999
INSTALL_DIR = "/usr/lib/aenv-codeinterp"
LAUNCHER = "aenv-codeinterp.py"
START_CMD = f"exec python3 {INSTALL_DIR}/{LAUNCHER}"
READY_CMD = f"curl -sf -o /dev/null http://127.0.0.1:{PORT}/health"
# A kernel with numpy and matplotlib loaded wants more than base's default.
MEMORY_MB = 1024
# The key in the build's metadata that says which rootfs the template was built from.
STAMP_KEY = "aenv-rootfs"

_SRC = Path(__file__).resolve().parent.parent  # src/aenv
# What the server needs inside the sandbox: its package and envd's HTTP server.
CODE_FILES = ("__init__.py", "envd/__init__.py", "envd/httpserver.py")


def _code_sources() -> list[tuple[str, Path]]:
    files = [(f"aenv/{rel}", _SRC / rel) for rel in CODE_FILES]
    files += [(f"aenv/codeinterp/{p.name}", p) for p in sorted((_SRC / "codeinterp").glob("*.py"))]
    return files


def _stage_code(dest: Path) -> None:
    """The server code layer at `dest`: root-owned, fixed mtimes (a stable digest)."""
    root = dest / INSTALL_DIR.lstrip("/")
    for rel, src in _code_sources():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
    (root / LAUNCHER).write_text(
        "# The code interpreter server (aenv.codeinterp) on port 49999.\n"
        "from aenv.codeinterp.__main__ import main\n\nmain()\n"
    )
    for p in [dest, *dest.rglob("*")]:
        os.chown(p, 0, 0, follow_symlinks=False)
        p.chmod(0o755 if p.is_dir() else 0o644)
        os.utime(p, (0, 0), follow_symlinks=False)


def rootfs_record(settings: Settings, layers: list[str], stamp: str) -> TemplateRecord:
    return TemplateRecord(
        template_id=ROOTFS_ID,
        kind=TemplateKind.IMAGE,
        layers=layers,
        internal=True,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        env={"PATH": PATH, "LANG": "C.UTF-8"},
        workdir=f"/home/{USER_NAME}",
        user=USER_NAME,
        cpu_count=settings.default_cpu_count,
        memory_mb=MEMORY_MB,
        build=BuildInfo(source="aenv code interpreter", rootfs_stamp=stamp),
    )


def layers_stamp(layers: list[str]) -> str:
    return hashlib.sha256("\n".join(layers).encode()).hexdigest()[:16]


def ensure_rootfs(settings: Settings, *, progress: ProgressFn | None = None) -> str:
    """Makes sure template `code-interpreter-v1-rootfs` is registered over the current
    packages layer and server code; returns its stamp (a hash of its layers)."""
    if os.geteuid() != 0:
        raise BaseBuildError("building the code interpreter template needs root (chroot, mount)")
    base_layers = base_template.build_base(settings, progress=progress)
    store = LayerStore(settings)
    pkg_dir, meta = ensure_cached_layer(settings, progress=progress)
    if meta["base_digest"] not in base_layers:
        raise BaseBuildError(
            f"the cached packages layer was built over {meta['base_digest']}, "
            f"not over template base ({base_layers[0]})"
        )
    with flock(store.root / ".code-interpreter.lock"):
        pkg = store.add_dir(
            pkg_dir, digest=meta["digest"], mode="link", source="code interpreter packages"
        )
        store.tmp.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix="ci-code-", dir=store.tmp))
        try:
            _stage_code(stage)
            digest, _size, _files = tree_digest(stage)
            code = store.add_dir(
                stage, digest=digest, mode="move", source="code interpreter server"
            )
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        layers = [code, pkg, *base_layers]
        stamp = layers_stamp(layers)
        catalog = Catalog(settings.catalog_path)
        try:
            old = catalog.template(ROOTFS_ID)
            if old is None or old.layers != layers:
                catalog.put_template(rootfs_record(settings, layers, stamp))
        finally:
            catalog.close()
    if progress:
        progress("rootfs", f"template {ROOTFS_ID} = {len(layers)} layers")
    return stamp


def is_current(settings: Settings, stamp: str) -> bool:
    """Whether template `code-interpreter-v1` is built (with memory) from this rootfs."""
    if not settings.catalog_path.exists():
        return False
    catalog = Catalog(settings.catalog_path)
    try:
        rec = catalog.template(TEMPLATE_NAME)
    finally:
        catalog.close()
    return rec is not None and rec.has_memory and rec.build.metadata.get(STAMP_KEY) == stamp


def build_spec(stamp: str) -> dict[str, Any]:
    """The E2B build of `code-interpreter-v1` over the rootfs template."""
    return {
        "fromTemplate": ROOTFS_ID,
        "steps": [],
        "startCmd": START_CMD,
        "readyCmd": READY_CMD,
        "metadata": {STAMP_KEY: stamp},
    }
