"""The volume store: every volume under one root, which may be a file system several nodes
share (NFS...). Nothing about a volume is kept anywhere else:

    <root>/names/<name>       a symlink to the volume's id: the name's claim (creating a
                              symlink is atomic, over NFS too) and what makes it exist
    <root>/<id>/volume.json   id, name, token, creation time (replaced atomically, 0600)
    <root>/<id>/data/         its files: what sandboxes mount and /volumecontent serves

A create writes the volume's directory, then claims the name; a delete drops the name, then
the directory. A crash between leaves a directory no name points to, which nobody sees.
Blocking: callers in the server run these in a thread."""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import posixpath
import re
import secrets
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from ..domain import MountRequest, VolumeMount, new_id, utcnow
from ..errors import BadRequest, Conflict, NotFound, Unauthorized
from ..fsutil import PRIVATE_DIR, private_dir, rmtree, write_private

# E2B's NewVolume pattern; the length bound is ours (E2B documents none).
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ID = re.compile(r"v[a-z0-9]{19}")
MAX_MOUNT_PATH = 1024
MAX_MOUNTS = 16
# A new volume's top directory: owned by E2B's default sandbox user (`user`, 1000), and
# writable by every user of every image (templates may run commands as another); no other
# host user reaches it (the root is 0700). What the content API makes inherits its owner.
DATA_MODE = 0o777
DATA_OWNER = 1000


@dataclass(frozen=True)
class VolumeRecord:
    volume_id: str
    name: str
    # What /volumecontent requests for this volume carry (`Authorization: Bearer`).
    token: str
    created_at: str


def check_volume_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise BadRequest(f"invalid volume name {name!r}: use 1-64 letters, digits, '_' or '-'")


def check_mount_path(path: str, reserved: Iterable[str] = ()) -> str:
    """The mount point as given (absolute, normalized, not `/`, not on or around a path
    the sandbox needs: `reserved`), or BadRequest."""
    if not path.startswith("/") or "\0" in path or len(path) > MAX_MOUNT_PATH:
        raise BadRequest(f"invalid volume mount path {path!r}: must be an absolute path")
    norm = posixpath.normpath(path)
    if norm != path.rstrip("/") or norm == "/" or norm.startswith("//"):
        raise BadRequest(
            f"invalid volume mount path {path!r}: must be a normalized absolute path, not /"
        )
    for r in reserved:
        if _nested(norm, r):
            raise BadRequest(f"volume mount path {path!r} overlaps {r}, which the sandbox needs")
    return norm


def _nested(a: str, b: str) -> bool:
    """One of the two paths is the other or lies below it."""
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


class VolumeStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def _names(self) -> Path:
        return self.root / "names"

    def _meta(self, volume_id: str) -> Path:
        return self.root / volume_id / "volume.json"

    # ------------------------------------------------------------------ records
    def create(self, name: str) -> VolumeRecord:
        check_volume_name(name)
        private_dir(self.root)
        private_dir(self._names)
        if self._names.joinpath(name).is_symlink():
            raise Conflict(f"a volume named {name!r} already exists")
        rec = VolumeRecord(
            volume_id=new_id("v"),
            name=name,
            token=secrets.token_urlsafe(32),
            created_at=utcnow().isoformat(),
        )
        vdir = self.root / rec.volume_id
        vdir.mkdir(mode=PRIVATE_DIR)
        data = vdir / "data"
        data.mkdir()
        os.chown(data, DATA_OWNER, DATA_OWNER)
        os.chmod(data, DATA_MODE)  # whatever the umask
        write_private(self._meta(rec.volume_id), json.dumps(asdict(rec)).encode())
        try:
            os.symlink(rec.volume_id, self._names / name)
        except FileExistsError:  # another create (maybe on another node) won the name
            rmtree(vdir)
            raise Conflict(f"a volume named {name!r} already exists") from None
        return rec

    def all(self) -> list[VolumeRecord]:
        if not self._names.is_dir():
            return []
        out = []
        for entry in os.scandir(self._names):
            rec = self.by_name(entry.name)
            if rec is not None:
                out.append(rec)
        return sorted(out, key=lambda r: (r.created_at, r.volume_id))

    def by_name(self, name: str) -> VolumeRecord | None:
        if not _NAME.fullmatch(name):
            return None
        try:
            volume_id = os.readlink(self._names / name)
        except (FileNotFoundError, OSError):
            return None
        rec = self._read(volume_id)
        return rec if rec is not None and rec.name == name else None

    def get(self, volume_id: str) -> VolumeRecord:
        rec = self._read(volume_id) if _ID.fullmatch(volume_id) else None
        # Only a volume its name points to exists (a delete drops the name first).
        if rec is None or self.by_name(rec.name) != rec:
            raise NotFound(f"volume {volume_id!r} not found")
        return rec

    def _read(self, volume_id: str) -> VolumeRecord | None:
        try:
            doc = json.loads(self._meta(volume_id).read_text())
            return VolumeRecord(**doc)
        except (OSError, ValueError, TypeError):
            return None

    def delete(self, volume_id: str) -> VolumeRecord:
        rec = self.get(volume_id)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._names / rec.name)
        rmtree(self.root / volume_id)
        return rec

    def authorize(self, volume_id: str, token: str) -> VolumeRecord:
        """The volume whose content `token` opens; Unauthorized for any other token."""
        rec = self.get(volume_id)
        if not token or not hmac.compare_digest(token.encode(), rec.token.encode()):
            raise Unauthorized(f"invalid token for volume {volume_id!r}")
        return rec

    def data_dir(self, volume_id: str) -> Path:
        """The volume's files (what a sandbox mounts); NotFound once it is deleted."""
        self.get(volume_id)
        return self.root / volume_id / "data"

    # ------------------------------------------------------------------ mounts
    def resolve(
        self, wanted: Iterable[MountRequest], reserved: Iterable[str] = ()
    ) -> list[VolumeMount]:
        """A create's `volumeMounts` as mounts of existing volumes; BadRequest naming the
        first bad one (unknown volume, bad or overlapping path)."""
        reserved = tuple(reserved)
        out: list[VolumeMount] = []
        for w in wanted:
            check_volume_name(w.name)
            path = check_mount_path(w.path, reserved)
            for m in out:
                if _nested(path, m.path):
                    raise BadRequest(f"volume mount paths {m.path!r} and {path!r} overlap")
            rec = self.by_name(w.name)
            if rec is None:
                raise BadRequest(f"volume {w.name!r} not found (volumeMounts)")
            out.append(VolumeMount(rec.volume_id, rec.name, path, w.read_only))
        if len(out) > MAX_MOUNTS:
            raise BadRequest(f"at most {MAX_MOUNTS} volume mounts per sandbox")
        return out

    def check_present(self, mounts: Iterable[VolumeMount]) -> None:
        """BadRequest when a volume the mounts name was deleted since."""
        for m in mounts:
            try:
                self.get(m.volume_id)
            except NotFound:
                raise BadRequest(f"volume {m.name!r} (mounted at {m.path}) was deleted") from None
