"""What the gVisor backend knows of one container, and how it travels: in `Instance.data`
(the orchestrator stores it, opaque) and in the bundle's `instance.json` (what `start`
recovers after a crash). Only this module reads or writes either."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.domain import Instance
from aenv.errors import RuntimeFailure
from aenv.runtime.base import SandboxSpec
from aenv.runtime.net.network import Slot

OVERLAY_MEMORY = "root:memory"  # rootfs writes in the sentry's memory (no `upper`)
OVERLAY_NONE = "none"  # rootfs writes to the host overlay's upper dir

INSTANCE_FILE = "instance.json"
_PATH_FIELDS = ("bundle_dir", "upper", "workdir", "rootfs_mount")


_MAX_SOCKET_PATH = 107  # runsc's control socket `<root>/runsc-<id>.sock` (sun_path)


def new_container_id(sandbox_id: str, runsc_root: Path) -> str:
    """A fresh container id for a sandbox (one per boot), refused when its control socket's
    path would not fit."""
    cid = f"{sandbox_id}-{secrets.token_hex(4)}"
    if len(str(runsc_root / f"runsc-{cid}.sock")) > _MAX_SOCKET_PATH:
        raise RuntimeFailure(
            f"sandbox id {sandbox_id!r} too long for a runsc control socket under {runsc_root}"
        )
    return cid


@dataclass
class Container:
    sandbox_id: str
    # The runsc container id (`Instance.id`): `<sandbox_id>-<8 hex>`.
    id: str
    address: str
    # The network slot's index (see `network.py`).
    slot: int
    # `<sandboxes_dir>/<sandbox_id>/<id>`: config.json, instance.json, rootfs/, logs.
    bundle_dir: Path
    overlay: str = OVERLAY_MEMORY
    cpu_count: int = 1
    memory_mb: int = 0
    cgroup: str = ""
    # With a writable host overlay (`spec.upper` set): its upper, work dir and mount point.
    upper: Path | None = None
    workdir: Path | None = None
    rootfs_mount: Path | None = None
    # Without: the shared read-only stack it holds a reference on (`rootfs.RootfsMounts`).
    rootfs_key: str | None = None
    pid: int = 0
    gofer_pid: int = 0
    started_at: float = 0.0
    restored_from: str | None = None
    # After `stop`: no container, the slot kept.
    stopped: bool = False
    stopped_at: float | None = None
    # After `checkpoint(leave_running=False)`: the sandbox exits on its own.
    checkpointed: bool = False

    @classmethod
    def for_spec(
        cls, spec: SandboxSpec, cid: str, slot: Slot, sandboxes_dir: Path, cgroup: str
    ) -> Container:
        """A new container of `spec` in `slot`, its bundle under `sandboxes_dir`."""
        bundle = sandboxes_dir / spec.sandbox_id / cid
        c = cls(
            sandbox_id=spec.sandbox_id,
            id=cid,
            address=slot.router_ip,
            slot=slot.index,
            bundle_dir=bundle,
            overlay=OVERLAY_MEMORY if spec.upper is None else OVERLAY_NONE,
            cpu_count=spec.cpu_count,
            memory_mb=spec.memory_mb,
            cgroup=cgroup,
        )
        if spec.upper is not None:
            c.upper = spec.upper
            c.workdir = spec.upper.parent / f"work-{cid}"
            c.rootfs_mount = bundle / "rootfs"
        return c

    def handle(self) -> Instance:
        return Instance(self.sandbox_id, self.id, self.address, self.data())

    def data(self) -> dict[str, Any]:
        """The fields an `Instance` does not carry itself, as JSON values."""
        out = dataclasses.asdict(self)
        for name in ("sandbox_id", "id", "address"):
            del out[name]
        for name in _PATH_FIELDS:
            if out[name] is not None:
                out[name] = str(out[name])
        return out

    def write_to(self, inst: Instance) -> None:
        """Brings a caller's handle up to date (it may be stored or passed back later)."""
        inst.data.clear()
        inst.data.update(self.data())

    @classmethod
    def of(cls, inst: Instance) -> Container:
        """Reads a handle this backend made; raises ValueError if it did not."""
        return cls._parse(
            {**inst.data, "sandbox_id": inst.sandbox_id, "id": inst.id, "address": inst.address}
        )

    @classmethod
    def _parse(cls, d: dict[str, Any]) -> Container:
        d = dict(d)
        # instance.json of the previous layout: `container_id` and the rest under `extra`.
        if "container_id" in d:
            d["id"] = d.pop("container_id")
        extra = d.pop("extra", None)
        if isinstance(extra, dict):
            d = {**extra, **d}
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        try:
            for name in _PATH_FIELDS:
                if d.get(name) is not None:
                    d[name] = Path(str(d[name]))
            for name in ("slot", "cpu_count", "memory_mb", "pid", "gofer_pid"):
                if d.get(name) is not None:
                    d[name] = int(d[name])
            for name in ("stopped", "checkpointed"):
                d[name] = bool(d.get(name))
            d["started_at"] = float(d.get("started_at") or 0.0)
            return cls(**d)
        except (TypeError, ValueError) as e:
            raise ValueError(f"not a gvisor instance: {e}") from e

    # instance.json -----------------------------------------------------------------------

    def save(self) -> None:
        """Writes instance.json into the bundle dir (atomically)."""
        doc = {"sandbox_id": self.sandbox_id, "id": self.id, "address": self.address}
        tmp = self.bundle_dir / f"{INSTANCE_FILE}.tmp"
        tmp.write_text(json.dumps({**doc, **self.data()}, indent=1))
        tmp.replace(self.bundle_dir / INSTANCE_FILE)

    @classmethod
    def load(cls, bundle: Path) -> Container | None:
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads((bundle / INSTANCE_FILE).read_text())
            if isinstance(doc, dict):
                return cls._parse(doc)
        return None
