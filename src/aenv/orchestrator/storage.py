"""The orchestrator's on-disk pieces of a sandbox: writable uppers and checkpoint images.

Layout under $AENV_HOME:
    rw/<sandbox_id>/<generation>/upper    the overlay upper the sandbox writes into
    disks/<sandbox_id>.ext4               the disk mounted on rw/<sandbox_id> (its size limit,
                                          `runtime/storage/disks.py`; without disk limits rw/ is plain)
    store.btrfs                           or, instead of the disks, the btrfs pool holding
                                          layers/ and rw/ (`runtime/storage/cowpool.py`): each
                                          rw/<sandbox_id> a subvolume with its size as quota
    images/<name>/                        a runsc checkpoint image (memory + processes)

A snapshot *seals* the current upper: it is renamed into the layer store as a new read-only
layer (a rename without disk limits; a copy of what was written with them, the disk being
a filesystem of its own) and the sandbox continues on a fresh empty upper of the next
generation on top of it.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from pathlib import Path

from ..config import Settings
from ..fsutil import private_dir
from ..images.cache import LayerCache, holder
from ..images.diffcopy import copy_changes
from ..images.layers import LayerError, LayerStore
from ..runtime.storage.cowpool import CowPool
from ..runtime.storage.disks import Disks, SandboxDisks


class SandboxStorage:
    def __init__(self, settings: Settings, layers: LayerStore, pool: CowPool | None = None) -> None:
        self.settings = settings
        self.layers = layers
        # Who holds which layer (sandboxes, templates): held layers are never evicted.
        self.refs = LayerCache(layers)
        # Sandboxes' own files and memory: for root alone (fsutil's docstring).
        private_dir(settings.rw_dir)
        private_dir(settings.images_dir)
        # `pool`: the node's btrfs pool (`open_pool`), which copies uppers by reflink.
        self.disks: SandboxDisks | None = pool
        if pool is None and settings.disk_limits:
            self.disks = Disks(settings.disks_dir, settings.rw_dir, spares=settings.disk_spares)

    def first_upper(self, sandbox_id: str) -> Path:
        """Where a new sandbox's upper will be (made by `ensure_upper` when it boots)."""
        return self.settings.rw_dir / sandbox_id / "1" / "upper"

    def ensure_upper(self, sandbox_id: str, upper: Path, disk_mb: int) -> None:
        """Before a boot: the sandbox's disk mounted (made if new, its files kept if not)
        and its upper dir there."""
        if self.disks is not None:
            self.disks.attach(sandbox_id, disk_mb)
        upper.mkdir(parents=True, exist_ok=True)

    def refill_disks(self) -> None:
        if self.disks is not None:
            self.disks.refill(self.settings.default_disk_mb)

    def new_upper(self, sandbox_id: str) -> Path:
        """The upper of the sandbox's next generation (its disk is attached: it booted)."""
        base = self.settings.rw_dir / sandbox_id
        base.mkdir(parents=True, exist_ok=True)
        gens = [int(p.name) for p in base.iterdir() if p.name.isdigit()]
        gen = base / str(max(gens, default=0) + 1)
        (gen / "upper").mkdir(parents=True)
        return gen / "upper"

    @staticmethod
    def seal_digest(label: str) -> str:
        """A new digest for a sealed layer. It names the layer uniquely rather than hashing
        its content: hashing a freshly written GiB would put seconds on the snapshot path for
        no gain, since no two seals ever hold the same tree."""
        return "sha256:" + hashlib.sha256(f"{label}:{secrets.token_hex(16)}".encode()).hexdigest()

    def seal(self, upper: Path, label: str, digest: str | None = None) -> str:
        """Turns an upper dir into a read-only layer (named `digest`, a `seal_digest`, if
        given); returns its digest."""
        digest = digest or self.seal_digest(label)
        self.layers.add_dir(upper, digest, mode="move", source=f"sealed {label}")
        # The overlay's work dirs of that generation are scratch space: drop them.
        gen = upper.parent
        for p in gen.iterdir() if gen.exists() else []:
            shutil.rmtree(p, ignore_errors=True)
        if gen.exists() and not any(gen.iterdir()):
            gen.rmdir()
        return digest

    def copy_upper(self, upper: Path, label: str) -> str | None:
        """A read-only layer holding a copy of what the upper holds now (the sandbox goes on
        writing into the upper itself); None when the upper holds nothing."""
        if not upper.is_dir():
            return None
        with os.scandir(upper) as it:
            if next(it, None) is None:
                return None
        digest = self.seal_digest(label)
        self.layers.add_dir(upper, digest, mode="copy", source=f"files of {label}")
        return digest

    def copy_upper_since(self, upper: Path, label: str, copy: list[str]) -> str | None:
        """Like `copy_upper`, but only what changed since `copy` (layers, topmost first)
        was copied from this same upper (see images/diffcopy.py): the layer goes on top of
        `copy`. None when nothing changed. Raises `LayerError` when a layer is gone."""
        missing = [d for d in copy if not self.layers.has(d)]
        if missing:
            raise LayerError(f"layer {missing[0]} is gone")
        self.layers.tmp.mkdir(parents=True, exist_ok=True)
        stage = self.layers.tmp / f"diff-{secrets.token_hex(8)}"
        try:
            if copy_changes(upper, [self.layers.path(d) for d in copy], stage) == 0:
                return None
            digest = self.seal_digest(label)
            self.layers.add_dir(stage, digest, mode="move", source=f"changes of {label}")
            return digest
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def remove_sandbox(self, sandbox_id: str) -> None:
        if self.disks is not None:
            self.disks.detach(sandbox_id)
        shutil.rmtree(self.settings.rw_dir / sandbox_id, ignore_errors=True)

    def sweep_uppers(self, uppers: dict[str, tuple[str | None, str | None]]) -> int:
        """At start-up: removes what sandboxes no longer use under `rw/` (left by a crash):
        the dirs of sandboxes not in `uppers` (sandbox id -> (its upper, the container id
        whose overlay work dir is in use)), and of those that are, every generation but the
        one of their upper and every work dir but the one in use. Returns how many went."""
        removed = 0
        root = self.settings.rw_dir
        for d in sorted(root.iterdir()) if root.is_dir() else []:
            if d.name not in uppers:
                self.remove_sandbox(d.name)  # its disk first, if it has one
                removed += 1
                continue
            upper, cid = uppers[d.name]
            if upper is None:
                continue
            gen = Path(upper).parent
            for g in d.iterdir():
                if g != gen:
                    shutil.rmtree(g, ignore_errors=True)
                    removed += 1
            for w in gen.glob("work-*") if gen.is_dir() else []:
                if w.name != f"work-{cid}":
                    shutil.rmtree(w, ignore_errors=True)
                    removed += 1
        if self.disks is not None:
            for sandbox_id in self.disks.owners() - set(uppers):
                self.disks.detach(sandbox_id)  # a disk whose mount point went already
                removed += 1
        return removed

    def attach_disk(self, sandbox_id: str, disk_mb: int) -> None:
        """Mounts the sandbox's disk if it has one and it is not (after a host reboot)."""
        if self.disks is not None:
            self.disks.remount(sandbox_id, disk_mb)

    def disk_usage(self, sandbox_id: str, disk_mb: int) -> tuple[int, int]:
        """(used, total) bytes of the sandbox's own disk; without disk limits there is no
        filesystem of its own to ask, so (0, its nominal size)."""
        if self.disks is None:
            return 0, disk_mb * 1024 * 1024
        return self.disks.usage(sandbox_id, disk_mb)

    def sweep_images(self, used: set[str]) -> int:
        """At start-up: removes the memory images nothing refers to (partly written by an
        operation a crash cut short, or given up while the server stopped)."""
        removed = 0
        for d in sorted(self.settings.images_dir.iterdir()):
            if d.name not in used:
                shutil.rmtree(d, ignore_errors=True)
                removed += 1
        return removed

    def sweep_holds(self, sandbox_ids: set[str]) -> int:
        """At start-up: drops the layer references of sandboxes that no longer exist."""
        gone = [
            h
            for h in self.refs.all_holders()
            if h.startswith("sandbox:") and h.split(":", 1)[1] not in sandbox_ids
        ]
        for h in gone:
            self.refs.release(h)
        return len(gone)

    def image_dir(self, name: str) -> Path:
        return self.settings.images_dir / name

    def fresh_image_dir(self, name: str) -> Path:
        d = self.image_dir(name)
        shutil.rmtree(d, ignore_errors=True)
        d.parent.mkdir(parents=True, exist_ok=True)
        return d

    def remove_image(self, name: str) -> None:
        shutil.rmtree(self.image_dir(name), ignore_errors=True)

    def link_image(self, src: Path, dst: str) -> Path:
        """A second name for an image (hard links: images are never modified in place)."""
        d = self.fresh_image_dir(dst)
        d.mkdir()
        for f in src.iterdir():
            os.link(f, d / f.name)
        return d

    def hold(self, kind: str, ident: str, digests: list[str]) -> None:
        """Keeps layers from eviction on behalf of `kind`/`ident` (a sandbox, a build, a
        pull...) until `release(kind, ident)`."""
        self.refs.ref_many(digests, holder(kind, ident))

    def unhold(self, kind: str, ident: str, digests: list[str]) -> None:
        who = holder(kind, ident)
        for d in digests:
            self.refs.unref(d, who)

    def release(self, kind: str, ident: str) -> None:
        self.refs.release(holder(kind, ident))
