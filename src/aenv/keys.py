"""The node's named API keys: created, listed and revoked on the node host, read by the
server without a restart.

The keys live in one JSON file under ``$AENV_HOME/secrets/`` (mode 0600), each as a random
salt and ``sha256(salt + key)``, never the key itself. A plain salted SHA-256 is enough here:
a key is 160 random bits (``e2b_`` + 40 hex, the shape the E2B SDK checks), so there is
nothing for a slow password hash to protect against a stolen file, and a fast hash keeps
every request's check in microseconds.

Writers (the ``aenv keys`` commands, the server's first start) take a file lock and replace
the file atomically, so readers never see half a file and concurrent writers never lose each
other's keys. The server re-reads the file only when its stat signature changes, so a
revocation takes effect on the next request without a restart or a per-request read.

The key of older nodes, kept in plain text in ``secrets/api-key`` (which the CLI reads by
default), is taken into the store as the key named ``default`` the first time the store is
written; revoking ``default`` also deletes that plain-text copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .domain import Quota
from .errors import BadRequest, Conflict, InternalError, NotFound, Unauthorized
from .fsutil import flock, write_private

if TYPE_CHECKING:
    from starlette.datastructures import Headers

    from .config import Settings

log = logging.getLogger("aenv.keys")

DEFAULT_NAME = "default"
KEY_PREFIX = "e2b_"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# Shown by `aenv keys ls` to tell keys apart: 24 of 160 bits, too few to help a guess.
_DISPLAY_LEN = len(KEY_PREFIX) + 6

# (inode, mtime, ctime, size): a new file (atomic replace) or a new write changes it.
_Signature = tuple[int, int, int, int]


API_KEY_HEADER = "x-api-key"


def presented_key(headers: Headers) -> str:
    """The one key a request carries (`X-API-Key` or `Authorization: Bearer`), for a node's
    API and a gateway's own routes alike; Unauthorized when none or more than one."""
    values = [v.strip() for v in headers.getlist(API_KEY_HEADER)]
    for auth in headers.getlist("authorization"):
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() == "bearer":
            values.append(token.strip())
    if not values:
        raise Unauthorized("missing API key: send X-API-Key or Authorization: Bearer")
    if len(values) > 1:
        raise Unauthorized("API key sent more than once (X-API-Key / Authorization)")
    return values[0]


def new_key() -> str:
    return KEY_PREFIX + secrets.token_hex(20)


def _digest(salt: bytes, key: str) -> bytes:
    return hashlib.sha256(salt + key.encode()).digest()


@dataclass(frozen=True)
class ApiKey:
    """One stored key: what `aenv keys ls` shows, and the salted hash to check against."""

    name: str
    prefix: str
    created: datetime
    salt: bytes
    digest: bytes
    # What its sandboxes may hold on a node at once (`aenv keys set`); no limits by default.
    quota: Quota = Quota()

    @classmethod
    def make(
        cls, name: str, key: str, created: datetime | None = None, quota: Quota | None = None
    ) -> ApiKey:
        salt = secrets.token_bytes(16)
        return cls(
            name=name,
            prefix=key[:_DISPLAY_LEN],
            created=created or datetime.now(UTC),
            salt=salt,
            digest=_digest(salt, key),
            quota=quota or Quota(),
        )

    def matches(self, key: str) -> bool:
        return hmac.compare_digest(_digest(self.salt, key), self.digest)

    def listing(self) -> dict[str, Any]:
        """The public part (no salt, no hash), as `aenv keys ls -o json` prints it."""
        return {
            "name": self.name,
            "prefix": self.prefix,
            "created": self.created.isoformat(),
            "maxSandboxes": self.quota.max_sandboxes,
            "maxMemoryMB": self.quota.max_memory_mb,
        }

    def to_json(self) -> dict[str, Any]:
        return {**self.listing(), "salt": self.salt.hex(), "sha256": self.digest.hex()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ApiKey:
        return cls(
            name=str(data["name"]),
            prefix=str(data["prefix"]),
            created=datetime.fromisoformat(str(data["created"])),
            salt=bytes.fromhex(str(data["salt"])),
            digest=bytes.fromhex(str(data["sha256"])),
            quota=Quota(
                max_sandboxes=_limit(data.get("maxSandboxes")),
                max_memory_mb=_limit(data.get("maxMemoryMB")),
            ),
        )


def _limit(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a quota must be a whole number >= 0, not {value!r}")
    return value


def check_name(name: str) -> str:
    if not _NAME_RE.fullmatch(name):
        raise BadRequest(
            f"invalid key name {name!r}: 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


class KeyStore:
    """The key file at `path`; `legacy_file` is the plain-text key of older nodes."""

    def __init__(self, path: Path, legacy_file: Path | None = None) -> None:
        self.path = path
        self.legacy_file = legacy_file
        self._lock_path = path.with_name(path.name + ".lock")
        self._cached: tuple[_Signature | None, tuple[ApiKey, ...]] | None = None

    @classmethod
    def of(cls, settings: Settings) -> KeyStore:
        return cls(settings.api_keys_file, settings.api_key_file)

    # -- reading ----------------------------------------------------------------------------

    def _signature(self) -> _Signature | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)

    def _read(self) -> tuple[ApiKey, ...]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return ()
        except OSError as exc:
            raise InternalError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
            return tuple(ApiKey.from_json(item) for item in data["keys"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InternalError(f"{self.path} is not a valid key file: {exc}") from None

    def entries(self) -> tuple[ApiKey, ...]:
        """The stored keys, re-read only when the file changed since the last call."""
        sig = self._signature()
        if self._cached is not None and self._cached[0] == sig:
            return self._cached[1]
        try:
            keys = self._read()
        except InternalError as exc:
            # Fail closed: a broken file authenticates nobody (AENV_API_KEY still works) and
            # is not re-parsed on every request until it changes again.
            log.error("%s; no stored API key is accepted until it is fixed", exc.message)
            keys = ()
        self._cached = (sig, keys)
        return keys

    def verify(self, key: str) -> ApiKey | None:
        """The stored key equal to `key`, or None. Every stored hash is compared (in
        constant time), so the time taken says nothing about which key, if any, matched."""
        found: ApiKey | None = None
        for entry in self.entries():
            if entry.matches(key) and found is None:
                found = entry
        return found

    # -- writing (under the lock) -------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # The directory first, private: the lock would otherwise create it world-readable.
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with flock(self._lock_path):
            yield

    def _current(self) -> list[ApiKey]:
        """The keys to update: the file's, or on the first write the legacy key as
        `default` (so creating a first named key does not lock the old key out)."""
        if self.path.exists():
            return list(self._read())
        legacy = self._legacy_key()
        if not legacy:
            return []
        assert self.legacy_file is not None
        made = datetime.fromtimestamp(self.legacy_file.stat().st_mtime, UTC)
        return [ApiKey.make(DEFAULT_NAME, legacy, created=made)]

    def listed(self) -> list[ApiKey]:
        """What `aenv keys ls` shows: the stored keys, or before the store's first write
        the legacy key that will become `default`."""
        return list(self._read()) if self.path.exists() else self._current()

    def _legacy_key(self) -> str | None:
        if self.legacy_file is None:
            return None
        try:
            return self.legacy_file.read_text().strip() or None
        except FileNotFoundError:
            return None

    def _write(self, keys: list[ApiKey]) -> None:
        body = json.dumps({"version": 1, "keys": [k.to_json() for k in keys]}, indent=2) + "\n"
        old = self._signature()
        _write_private(self.path, body)
        if old is not None:
            # Readers compare stat signatures; coarse file-system clocks could give two quick
            # writes of equal size (and a reused inode) the same one, so move mtime forward.
            st = self.path.stat()
            if st.st_mtime_ns <= old[1]:
                os.utime(self.path, ns=(st.st_atime_ns, old[1] + 1))

    def create(self, name: str, quota: Quota | None = None) -> tuple[str, ApiKey]:
        """A new random key named `name` (unique): (the key, shown once; its record)."""
        check_name(name)
        with self._locked():
            keys = self._current()
            if any(k.name == name for k in keys):
                raise Conflict(f"an API key named {name!r} already exists")
            key = new_key()
            entry = ApiKey.make(name, key, quota=quota)
            self._write([*keys, entry])
        return key, entry

    def set_quota(self, name: str, quota: Quota) -> ApiKey:
        """Replaces the quota of key `name`; a running server applies it to its next create."""
        with self._locked():
            keys = self._current()
            for i, k in enumerate(keys):
                if k.name == name:
                    keys[i] = replace(k, quota=quota)
                    self._write(keys)
                    return keys[i]
        raise NotFound(f"no API key named {name!r}")

    def quota_of(self, name: str) -> Quota | None:
        """Key `name`'s quota (None: no such key, or one without limits)."""
        for k in self.entries():
            if k.name == name:
                q = k.quota
                return None if q.max_sandboxes is None and q.max_memory_mb is None else q
        return None

    def remove(self, name: str, *, allow_last: bool = False) -> ApiKey:
        """Revokes `name`. The last key goes only with `allow_last`: after it, only
        AENV_API_KEY (when the server has one) opens the control plane."""
        with self._locked():
            keys = self._current()
            entry = next((k for k in keys if k.name == name), None)
            if entry is None:
                raise NotFound(f"no API key named {name!r}")
            rest = [k for k in keys if k.name != name]
            if not rest and not allow_last:
                raise Conflict(
                    f"{name!r} is the last API key: without it only AENV_API_KEY opens the "
                    "control plane; pass --force to revoke it anyway"
                )
            self._write(rest)
            legacy = self._legacy_key()
            if self.legacy_file is not None and legacy is not None and entry.matches(legacy):
                # A revoked key must not stay on disk in plain text (nor be sent by the CLI).
                self.legacy_file.unlink(missing_ok=True)
        return entry

    def bootstrap(self, *, generate: bool) -> str | None:
        """At server start: makes sure the store exists. Takes in the legacy key, or (when
        `generate` and there is none) makes a `default` key, also written in plain text to
        the legacy file for the CLI, and returns it so it can be shown. A store that exists,
        even empty after revocations, is left alone: the node never re-opens itself."""
        with self._locked():
            if self.path.exists():
                return None
            keys = self._current()
            fresh: str | None = None
            if not keys:
                if not generate or self.legacy_file is None:
                    return None
                fresh = new_key()
                _write_private(self.legacy_file, fresh + "\n")
                keys = [ApiKey.make(DEFAULT_NAME, fresh)]
            self._write(keys)
        return fresh


def _write_private(path: Path, text: str) -> None:
    """Replaces `path` atomically with `text`, readable by its owner only."""
    write_private(path, text.encode())
