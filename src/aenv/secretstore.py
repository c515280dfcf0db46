"""The node's secrets (E2B's `/secrets`): named values an API key stores and its sandboxes'
egress rules name as `${e2b.secrets.NAME}`, resolved only in the egress proxy, outside the
sandbox.

Values are write-only: they go in through `create` and `update` and come out only through
`lookup`, which the egress proxy calls per request; no listing, log line or record holds
one. At rest each value is sealed with AES-256-GCM under the node's secrets key (the file
`$AENV_HOME/secrets/secrets.key`, 0600, made at the first start; or `AENV_SECRETS_KEY`, the
same key for every node of a cluster), its associated data binding it to its owner, id and
version, so a value copied to another entry does not open. The store is one JSON file
beside the key (`secrets.json`, 0600, replaced atomically), read once at start and kept in
memory; writes go to disk off the event loop.

Secrets belong to the API key that made them (by name; AENV_API_KEY's are its own): a key
sees, changes and resolves only its own. A name is unique per key, stored lower case.

In a cluster every node holds every secret: a node tells the cluster's copy of each change it
makes (`publish`, sealed entries only) and takes the others' (`sync`, at each heartbeat, and
`refreshed` before it answers about secrets or checks a create's rules), so a secret made
through one node is there for a sandbox on any other. The nodes share AENV_SECRETS_KEY.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .config import Settings
from .config.sections import SECRETS_KEY_BYTES as KEY_BYTES
from .config.sections import parse_secrets_key
from .errors import BadRequest, Conflict, InternalError, NotFound
from .fsutil import write_private

log = logging.getLogger("aenv.secrets")

ID_PREFIX = "sec_"  # E2B's: identifiers are sec_-prefixed, names may not be
NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,128}")
MAX_VALUE = 64 * 1024
MAX_METADATA = 32
MAX_META_KEY, MAX_META_VALUE, MAX_META_TOTAL = 128, 1024, 8192
NONCE_BYTES = 12


@dataclass(frozen=True)
class SecretInfo:
    """A secret as its owner may see it: never its value."""

    secret_id: str
    name: str
    owner: str | None
    version: int
    metadata: dict[str, str]
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class _Sealed:
    """A secret's current version as stored: its value sealed."""

    info: SecretInfo
    nonce: bytes
    sealed: bytes = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        i = self.info
        return {
            "id": i.secret_id,
            "name": i.name,
            "owner": i.owner,
            "version": i.version,
            "metadata": i.metadata,
            "created_at": i.created_at.isoformat(),
            "updated_at": i.updated_at.isoformat(),
            "nonce": base64.b64encode(self.nonce).decode(),
            "sealed": base64.b64encode(self.sealed).decode(),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> _Sealed:
        info = SecretInfo(
            secret_id=d["id"],
            name=d["name"],
            owner=d.get("owner"),
            version=int(d["version"]),
            metadata=dict(d.get("metadata") or {}),
            created_at=datetime.fromisoformat(d["created_at"]),
            updated_at=datetime.fromisoformat(d["updated_at"]),
        )
        return cls(info, base64.b64decode(d["nonce"]), base64.b64decode(d["sealed"]))


class SecretBox:
    """AES-256-GCM under one key; the associated data names what a value belongs to."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"the secrets key must be {KEY_BYTES} bytes, not {len(key)}")
        self._aead = AESGCM(key)

    @staticmethod
    def _aad(info: SecretInfo) -> bytes:
        return f"aenv-secret\0{info.owner or ''}\0{info.secret_id}\0{info.version}".encode()

    def seal(self, info: SecretInfo, value: str) -> _Sealed:
        nonce = os.urandom(NONCE_BYTES)
        return _Sealed(info, nonce, self._aead.encrypt(nonce, value.encode(), self._aad(info)))

    def open(self, entry: _Sealed) -> str:
        return self._aead.decrypt(entry.nonce, entry.sealed, self._aad(entry.info)).decode()


def node_key(settings: Settings) -> bytes:
    """AENV_SECRETS_KEY, else the node's key file (made on first use, 0600)."""
    key = settings.cluster_secrets_key()
    if key is not None:
        return key
    path = settings.secrets_key_file
    try:
        return parse_secrets_key(path.read_text())
    except FileNotFoundError:
        key = os.urandom(KEY_BYTES)
        write_private(path, base64.b64encode(key) + b"\n")
        return key


def check_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    """E2B's limits: 32 entries, keys 128 bytes, values 1024, all of it 8192."""
    meta = dict(metadata or {})
    if len(meta) > MAX_METADATA:
        raise BadRequest(f"metadata: at most {MAX_METADATA} entries")
    total = 0
    for k, v in meta.items():
        kb, vb = len(k.encode()), len(v.encode())
        if kb > MAX_META_KEY or vb > MAX_META_VALUE:
            raise BadRequest(
                f"metadata: keys are at most {MAX_META_KEY} bytes, values {MAX_META_VALUE}"
            )
        total += kb + vb
    if total > MAX_META_TOTAL:
        raise BadRequest(f"metadata: at most {MAX_META_TOTAL} bytes in all")
    return meta


def check_name(name: str) -> str:
    """The canonical (lower-case) name; BadRequest for one E2B would refuse."""
    if not NAME_RE.fullmatch(name):
        raise BadRequest(
            "secret name: 1 to 128 letters, digits, '_' or '-' (the name goes into "
            "${e2b.secrets.NAME})"
        )
    canonical = name.lower()
    if canonical.startswith(ID_PREFIX):
        raise BadRequest(f"secret name: the {ID_PREFIX!r} prefix is reserved for identifiers")
    return canonical


def _check_value(value: str) -> None:
    if len(value.encode()) > MAX_VALUE:
        raise BadRequest(f"secret value: at most {MAX_VALUE} bytes")


class SecretStore:
    """The secrets of every API key of this node, sealed in one file."""

    def __init__(self, path: Path, key: bytes) -> None:
        self.path = path
        self._box = SecretBox(key)
        self._entries: dict[str, _Sealed] = {}
        self._lock = asyncio.Lock()
        # The cluster's copy (a node of a cluster sets them, `cluster/agent.py`): told of
        # each change (a sealed entry as JSON, None for a delete), and asked for the others'.
        self.publish: Callable[[str, str | None], Awaitable[None]] | None = None
        self.refresh: Callable[[], Awaitable[None]] | None = None
        self._unopened: set[tuple[str, int]] = set()
        self._load()

    @classmethod
    def of(cls, settings: Settings) -> SecretStore:
        return cls(settings.secrets_file, node_key(settings))

    def _load(self) -> None:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        entries = [_Sealed.from_json(d) for d in doc.get("secrets", [])]
        self._entries = {e.info.secret_id: e for e in entries}
        for e in entries[:1]:  # the wrong key is an error at start, not at a sandbox's egress
            try:
                self._box.open(e)
            except Exception:
                raise InternalError(
                    f"{self.path}: the secrets key does not open the stored secrets "
                    "(was AENV_SECRETS_KEY or secrets.key changed?)"
                ) from None

    async def _save(self) -> None:
        doc = {"secrets": [e.to_json() for e in self._entries.values()]}
        data = json.dumps(doc, indent=1).encode()
        await asyncio.to_thread(write_private, self.path, data)

    # The cluster's copy -----------------------------------------------------------------------

    async def refreshed(self) -> None:
        """Takes the cluster's latest first (a node of a cluster), so a secret made or
        changed through another node is known here at once."""
        if self.refresh is not None:
            try:
                await self.refresh()
            except Exception as e:
                log.warning("the cluster's secrets not read: %s", e)

    async def sync(self, docs: Mapping[str, str], deleted: set[str]) -> bool:
        """Takes the cluster's entries (newer versions than ours, ones we lack) and drops the
        deleted; whether anything changed. An entry this node's key does not open is left
        out, logged once (the nodes' AENV_SECRETS_KEY differ)."""
        changed = False
        async with self._lock:
            for sid in deleted & self._entries.keys():
                del self._entries[sid]
                changed = True
            for sid, doc in docs.items():
                if sid in deleted:
                    continue
                e = _Sealed.from_json(json.loads(doc))
                have = self._entries.get(sid)
                if have is not None and have.info.version >= e.info.version:
                    continue
                try:
                    self._box.open(e)
                except Exception:
                    if (sid, e.info.version) not in self._unopened:
                        self._unopened.add((sid, e.info.version))
                        log.error(
                            "secret %s from the cluster does not open with this node's key "
                            "(give every node the same AENV_SECRETS_KEY)",
                            sid,
                        )
                    continue
                self._entries[sid] = e
                changed = True
            if changed:
                await self._save()
        return changed

    async def _tell(self, secret_id: str, entry: _Sealed | None) -> None:
        if self.publish is None:
            return
        try:
            await self.publish(secret_id, None if entry is None else json.dumps(entry.to_json()))
        except Exception as e:
            log.warning("secret %s not given to the cluster: %s", secret_id, e)

    # Reads ------------------------------------------------------------------------------------

    def _find(self, owner: str | None, ref: str) -> _Sealed:
        """By id (`sec_…`) or by name (any case), among the owner's own."""
        e = self._entries.get(ref)
        if e is None and not ref.startswith(ID_PREFIX):
            name = ref.lower()
            e = next(
                (
                    x
                    for x in self._entries.values()
                    if x.info.owner == owner and x.info.name == name
                ),
                None,
            )
        if e is None or e.info.owner != owner:
            raise NotFound(f"secret {ref!r} not found")
        return e

    def get(self, owner: str | None, ref: str) -> SecretInfo:
        return self._find(owner, ref).info

    def listed(self, owner: str | None) -> list[SecretInfo]:
        """The owner's secrets, oldest first (then by id: a stable order for paging)."""
        mine = [e.info for e in self._entries.values() if e.info.owner == owner]
        return sorted(mine, key=lambda i: (i.created_at, i.secret_id))

    def missing(self, owner: str | None, names: set[str]) -> list[str]:
        """Which of `names` (canonical) the owner has no secret of, sorted."""
        have = {e.info.name for e in self._entries.values() if e.info.owner == owner}
        return sorted(names - have)

    def lookup(self, owner: str | None, name: str) -> str | None:
        """The value of the owner's secret `name` (canonical), for the egress proxy only."""
        for e in self._entries.values():
            if e.info.owner == owner and e.info.name == name:
                return self._box.open(e)
        return None

    # Writes -----------------------------------------------------------------------------------

    async def create(
        self, owner: str | None, name: str, value: str, metadata: dict[str, str] | None
    ) -> SecretInfo:
        canonical = check_name(name)
        meta = check_metadata(metadata)
        _check_value(value)
        async with self._lock:
            if any(
                e.info.owner == owner and e.info.name == canonical for e in self._entries.values()
            ):
                raise Conflict(f"a secret named {canonical!r} already exists")
            now = datetime.now(UTC)
            info = SecretInfo(
                secret_id=ID_PREFIX + secrets.token_hex(12),
                name=canonical,
                owner=owner,
                version=1,
                metadata=meta,
                created_at=now,
                updated_at=now,
            )
            entry = self._entries[info.secret_id] = self._box.seal(info, value)
            await self._save()
        log.info("secret %s (%s) created", info.secret_id, info.name)
        await self._tell(info.secret_id, entry)
        return info

    async def update(
        self, owner: str | None, ref: str, value: str, metadata: dict[str, str] | None
    ) -> SecretInfo:
        """A new version with `value`; `metadata`, when given, replaces the stored one."""
        _check_value(value)
        meta = None if metadata is None else check_metadata(metadata)
        async with self._lock:
            old = self._find(owner, ref).info
            info = replace(
                old,
                version=old.version + 1,
                metadata=old.metadata if meta is None else meta,
                updated_at=datetime.now(UTC),
            )
            entry = self._entries[info.secret_id] = self._box.seal(info, value)
            await self._save()
        log.info("secret %s (%s) updated to version %d", info.secret_id, info.name, info.version)
        await self._tell(info.secret_id, entry)
        return info

    async def delete(self, owner: str | None, ref: str) -> None:
        async with self._lock:
            info = self._find(owner, ref).info
            del self._entries[info.secret_id]
            await self._save()
        log.info("secret %s (%s) deleted", info.secret_id, info.name)
        await self._tell(info.secret_id, None)
