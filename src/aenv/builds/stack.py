"""Host-side reads of a layer stack: a file as the merged rootfs would show it, users.

Layers are overlayfs lower dirs (topmost first): a 0/0 character device is a whiteout, an
opaque directory (`trusted.overlay.opaque=y`) hides what lies below it. Only what template
builds need is implemented: reading small files such as /etc/passwd without booting.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..images.overlay import lookup as _lookup

_MAX_READ = 4 << 20


def read_file(layers: list[Path], rel: str) -> bytes | None:
    """The content of `rel` (e.g. "etc/passwd") in the merged stack, None if absent.

    Symlinks are followed when they point inside the stack (absolute or relative)."""
    for _ in range(8):  # symlink hops
        found = _lookup(layers, rel.strip("/"))
        if found is None:
            return None
        path, st = found
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(path)
            base = os.path.dirname(rel.strip("/"))
            rel = os.path.normpath(target if target.startswith("/") else os.path.join(base, target))
            rel = rel.lstrip("/")
            if rel.startswith(".."):
                return None
            continue
        if not stat.S_ISREG(st.st_mode):
            return None
        with contextlib.suppress(OSError), open(path, "rb") as f:
            return f.read(_MAX_READ)
        return None
    return None


def exists(layers: list[Path], rel: str) -> bool:
    """Whether `rel` exists in the merged stack (a symlink counts, wherever it points)."""
    return _lookup(layers, rel.strip("/")) is not None if rel.strip("/") else True


@dataclass(frozen=True)
class PasswdEntry:
    name: str
    uid: int
    gid: int
    home: str


def parse_passwd(text: str) -> list[PasswdEntry]:
    out = []
    for line in text.splitlines():
        row = line.split(":")
        if len(row) < 7 or row[0].startswith("#"):
            continue
        try:
            out.append(PasswdEntry(row[0], int(row[2]), int(row[3]), row[5]))
        except ValueError:
            continue
    return out


def passwd(layers: list[Path]) -> list[PasswdEntry]:
    raw = read_file(layers, "etc/passwd")
    return parse_passwd(raw.decode("utf-8", "replace")) if raw else []


def resolve_user(entries: list[PasswdEntry], spec: str | None) -> tuple[str | None, str | None]:
    """A USER spec (`name`, `uid`, `name:group`, `uid:gid`) as a user name envd knows.

    Returns (name, warning). Empty spec: (None, None), the image's default. A user that
    does not exist in the image falls back to root, with a warning."""
    if not spec or not spec.strip():
        return None, None
    who = spec.strip().partition(":")[0]
    if who.isdigit():
        uid = int(who)
        for e in entries:
            if e.uid == uid:
                return e.name, None
        if uid == 0:
            return "root", None
        return "root", f"uid {uid} has no entry in the image's /etc/passwd; using root"
    if who == "root" or any(e.name == who for e in entries):
        return who, None
    return "root", f"user {who!r} does not exist in the image; using root"


def run_user_error(entries: list[PasswdEntry], cmd: str, spec: str) -> str | None:
    """Why a RUN step's own user (`run_cmd(..., user=)`) cannot run `cmd`, None when it can.

    Unlike a USER instruction (root with a warning), a command's explicit user that the
    image does not know fails the build, in the words of E2B's envd."""
    _name, warning = resolve_user(entries, spec)
    if warning is None:
        return None
    return (
        f"failed to run command '{cmd}': command failed: unauthenticated: "
        f"invalid username: '{spec.strip()}'"
    )


def default_user(entries: list[PasswdEntry]) -> str:
    """What envd picks without a configured user: `user` when it exists, else root."""
    return "user" if any(e.name == "user" for e in entries) else "root"
