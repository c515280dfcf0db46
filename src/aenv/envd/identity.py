"""A sandbox's own identity, renewed when /init names a sandbox envd has not been before.

Every sandbox is a restore of some checkpoint (the node's boot snapshot, a user's snapshot,
a fork's), so without this each one would carry its origin's identity byte for byte
(AgentENV issue #33). gVisor's sentry already reseeds the kernel's entropy on every restore
(it reads the host's getrandom), so `/dev/urandom`, `getrandom(2)` and everything seeded from
them in processes started afterwards differ; what the checkpoint does carry over is:

- `/etc/machine-id` (systemd, dbus and many tools' idea of "this machine"): written anew,
  with `/var/lib/dbus/machine-id` when that exists as its own file;
- `/proc/sys/kernel/random/boot_id`: gVisor restores its saved value and the file cannot be
  written, so a file with a fresh id is bind-mounted over it (needs envd's CAP_SYS_ADMIN,
  which only envd holds: see procfs.py);
- envd's own `random` module state (its children exec a new program, which seeds itself,
  but anything envd draws itself must not repeat in every child).

Processes that were already running at the checkpoint keep their in-memory PRNG state (a
Python `random`, a Go math/rand, OpenSSL's DRBG before it reseeds): nothing outside them
can change it (docs/architecture.md, "Fork-safe children"). The hostname is the fixed
"sandbox" of the OCI spec, not derived from the id, so it stays.

Stdlib only, like the rest of envd; every step is best effort and says what failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import uuid

MACHINE_ID = "/etc/machine-id"
DBUS_MACHINE_ID = "/var/lib/dbus/machine-id"
BOOT_ID = "/proc/sys/kernel/random/boot_id"
# Where the bind-mounted boot id lives: root's, outside anything a template ships.
BOOT_ID_SOURCE = "/run/aenv/boot_id"
_MS_BIND = 4096
_MS_RDONLY = 1
_MS_REMOUNT = 32
_MNT_DETACH = 2

# Set by __main__ in a sandbox's envd only: envd run by tests or on a developer's machine
# must never rewrite that machine's identity.
ENABLED = False


def _write(path: str, text: str, mode: int = 0o444) -> None:
    """Writes `path` anew (a new inode: a file a template hard-linked elsewhere is left)."""
    tmp = f"{path}.aenv-tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def renew_machine_id() -> str | None:
    """A fresh /etc/machine-id (32 hex digits, as systemd writes it); None, else why not."""
    mid = uuid.uuid4().hex
    try:
        _write(MACHINE_ID, mid + "\n")
        # Debian's dbus keeps its own copy unless it is a symlink to /etc/machine-id.
        if os.path.isfile(DBUS_MACHINE_ID) and not os.path.islink(DBUS_MACHINE_ID):
            _write(DBUS_MACHINE_ID, mid + "\n")
    except OSError as e:
        return f"machine-id: {e}"
    return None


def renew_boot_id(libc: ctypes.CDLL | None = None) -> str | None:
    """A fresh boot id over gVisor's restored one; None on success, else why not."""
    try:
        libc = libc or ctypes.CDLL(None, use_errno=True)
        os.makedirs(os.path.dirname(BOOT_ID_SOURCE), mode=0o755, exist_ok=True)
        _write(BOOT_ID_SOURCE, f"{uuid.uuid4()}\n")
    except OSError as e:
        return f"boot_id: {e}"
    target = BOOT_ID.encode()
    # The previous renewal's mount (carried over by the checkpoint) goes first, so forks of
    # forks do not stack mounts; not being a mount point (the first time) is fine.
    libc.umount2(target, _MNT_DETACH)
    if libc.mount(BOOT_ID_SOURCE.encode(), target, None, _MS_BIND, None) != 0:
        return f"boot_id: bind mount: {os.strerror(ctypes.get_errno())}"
    # Read-only like the file it hides (best effort: readable either way).
    libc.mount(None, target, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY, None)
    return None


def renew() -> list[str]:
    """Everything above; what could not be done (empty when all was)."""
    random.seed()  # from os.urandom, which the restored sentry has reseeded
    problems = [renew_machine_id(), renew_boot_id()]
    return [p for p in problems if p]
