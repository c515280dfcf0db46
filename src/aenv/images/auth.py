"""Registry authentication: credentials, `WWW-Authenticate` challenges, bearer tokens.

Anonymous first. A `401` with `WWW-Authenticate: Bearer realm=…,service=…` sends us to the
token endpoint for `repository:<name>:pull` (with Basic credentials when we have some);
`WWW-Authenticate: Basic` registries get the credentials directly. Tokens are cached per
registry and scope until they expire. Credentials come from an explicit mapping, the
settings (`registry_credentials`), or a docker `config.json` (`auths.<host>.auth`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..errors import BadGateway, BadRequest, Unauthorized, Unavailable
from ..registries import normalize_registry

log = logging.getLogger("aenv.images")


@dataclass(frozen=True)
class Credential:
    username: str
    password: str

    def basic(self) -> str:
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode()


def default_docker_config() -> Path:
    base = os.environ.get("DOCKER_CONFIG")
    return Path(base) / "config.json" if base else Path.home() / ".docker" / "config.json"


def load_docker_config(path: Path) -> dict[str, Credential]:
    """Credentials in a docker `config.json`: `auths.<host>.auth` (base64 `user:pass`) or
    `username`/`password`. Credential helpers (`credsStore`, `credHelpers`) are not run."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable docker config %s: %s", path, e)
        return {}
    out: dict[str, Credential] = {}
    auths = data.get("auths") if isinstance(data, dict) else None
    if not isinstance(auths, dict):
        return out
    for key, entry in auths.items():
        if not isinstance(entry, dict):
            continue
        user, pw = entry.get("username"), entry.get("password")
        if entry.get("auth"):
            try:
                decoded = base64.b64decode(str(entry["auth"]), validate=False).decode()
            except (binascii.Error, UnicodeDecodeError):
                log.warning("ignoring malformed auth for %s in %s", key, path)
                continue
            user, sep, pw = decoded.partition(":")
            if not sep:
                continue
        if user and pw is not None:
            out[normalize_registry(str(key))] = Credential(str(user), str(pw))
    return out


def parse_credentials(value: str | tuple[str, str] | Credential) -> Credential:
    if isinstance(value, Credential):
        return value
    if isinstance(value, tuple):
        return Credential(value[0], value[1])
    user, sep, pw = value.partition(":")
    if not sep:
        raise BadRequest("registry credentials must be 'user:password'")
    return Credential(user, pw)


_PARAM_RE = re.compile(r'([A-Za-z0-9_-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^,\s]*))')


@dataclass(frozen=True)
class Challenge:
    scheme: str  # "bearer" | "basic"
    params: Mapping[str, str]


def parse_challenge(header: str) -> Challenge | None:
    header = header.strip()
    if not header:
        return None
    scheme, _, rest = header.partition(" ")
    params = {
        m.group(1).lower(): (
            m.group(2).replace('\\"', '"') if m.group(2) is not None else m.group(3)
        )
        for m in _PARAM_RE.finditer(rest)
    }
    return Challenge(scheme.lower(), params)


@dataclass
class _Token:
    value: str
    expires: float
    anonymous: bool


class RegistryAuth:
    """What a client sends as `Authorization`, per registry: it learns each registry's
    challenge from a 401 and fetches (and caches) bearer tokens over `http`."""

    def __init__(self, http: httpx.AsyncClient, credentials: Mapping[str, Credential]) -> None:
        self._http = http
        self._creds = {normalize_registry(h): c for h, c in credentials.items()}
        self._challenges: dict[str, Challenge] = {}
        self._tokens: dict[tuple[str, str], _Token] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def credential(self, registry: str) -> Credential | None:
        return self._creds.get(normalize_registry(registry))

    def learn(self, registry: str, challenge: Challenge) -> None:
        self._challenges[registry] = challenge

    async def header(
        self, registry: str, scope: str, *, refresh: bool = False
    ) -> tuple[str | None, bool]:
        """(Authorization value or None, anonymous?) for a request to `registry`."""
        challenge = self._challenges.get(registry)
        if challenge is None:
            return None, True
        cred = self.credential(registry)
        if challenge.scheme == "basic":
            if cred is None:
                raise Unauthorized(
                    f"registry {registry} requires credentials (none configured for it)",
                    error_code="credentials_required",
                )
            return cred.basic(), False
        if challenge.scheme == "bearer":
            if refresh:
                self._tokens.pop((registry, scope), None)
            tok = await self._token(registry, scope, challenge)
            return f"Bearer {tok.value}", tok.anonymous
        raise BadGateway(
            f"registry {registry} asks for unsupported auth scheme {challenge.scheme!r}"
        )

    async def _token(self, registry: str, scope: str, challenge: Challenge) -> _Token:
        key = (registry, scope)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            tok = self._tokens.get(key)
            if tok and tok.expires > time.monotonic():
                return tok
            realm = challenge.params.get("realm")
            if not realm:
                raise BadGateway(f"registry {registry} sent a Bearer challenge without realm")
            params: dict[str, str] = {"scope": scope}
            if challenge.params.get("service"):
                params["service"] = challenge.params["service"]
            cred = self.credential(registry)
            headers = {"Authorization": cred.basic()} if cred else {}
            try:
                resp = await self._http.get(realm, params=params, headers=headers)
            except httpx.TransportError as e:
                raise Unavailable(
                    f"token service {realm} of registry {registry} unreachable: {exc_text(e)}"
                ) from e
            if resp.status_code in (401, 403):
                if cred:
                    raise Unauthorized(
                        f"bad credentials for registry {registry} (user {cred.username!r})",
                        error_code="bad_credentials",
                    )
                raise Unauthorized(
                    f"registry {registry} requires credentials (none configured for it)",
                    error_code="credentials_required",
                )
            if resp.status_code >= 400:
                raise BadGateway(
                    f"token service of registry {registry} failed with "
                    f"{resp.status_code}: {resp.text[:200]}"
                )
            try:
                data = resp.json()
                value = str(data.get("token") or data.get("access_token") or "")
                expires_in = int(data.get("expires_in") or 60)
            except (ValueError, AttributeError, TypeError):
                value, expires_in = "", 0
            if not value:
                raise BadGateway(f"token service of registry {registry} returned no token")
            # Renew a little early; never cache for less than a few seconds.
            tok = _Token(value, time.monotonic() + max(expires_in - 10, 5), anonymous=cred is None)
            self._tokens[key] = tok
            return tok


def exc_text(e: BaseException) -> str:
    """A transport error for a user, with the likely fix for a TLS failure."""
    text = str(e) or type(e).__name__
    if isinstance(e, httpx.ConnectError) and ("SSL" in text or "certificate" in text):
        text += " (if this registry speaks plain HTTP, list it in AENV_INSECURE_REGISTRIES)"
    return text
