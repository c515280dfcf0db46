"""An async client for OCI distribution (v2) registries: auth, manifests, blobs.

* Transport: HTTPS with certificate verification; plain HTTP only for registries listed in
  `insecure_registries` (`AENV_INSECURE_REGISTRIES`).
* Auth: anonymous first. A `401` with `WWW-Authenticate: Bearer realm=…,service=…` sends us
  to the token endpoint for `repository:<name>:pull` (with Basic credentials when we have
  some); `WWW-Authenticate: Basic` registries get the credentials directly. Tokens are cached
  per registry and scope until they expire. Credentials come from an explicit mapping, the
  settings (`registry_credentials`), or a docker `config.json` (`auths.<host>.auth`).
* Manifests: Docker schema 2 and OCI image manifests, Docker manifest lists and OCI indexes
  (a platform is selected; the default is the host's, `linux/amd64` on x86-64). Every
  manifest is checked against its digest.
* Blobs: streamed (`iter_blob`), resumed with `Range` after a dropped connection, checked
  against their digest by the consumer (`unpack`), or fetched whole and checked (`get_blob`).

Errors are aenv errors with messages meant for users: `NotFound` for an unknown image,
`Unauthorized`/`Forbidden` for refused credentials, `Unavailable` when the registry cannot
be reached, `BadGateway` when it answers nonsense (including content that fails its digest).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import os
import platform as _platform
import re
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ..errors import (
    AenvError,
    BadGateway,
    BadRequest,
    Forbidden,
    NotFound,
    TooManyRequests,
    Unauthorized,
    Unavailable,
)
from .reference import DOCKER_HUB, Reference, normalize_registry
from .settings import ImageSettings, RegistrySettings

log = logging.getLogger("aenv.images")

# --- media types ---
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_SCHEMA1 = "application/vnd.docker.distribution.manifest.v1+json"
DOCKER_SCHEMA1_SIGNED = "application/vnd.docker.distribution.manifest.v1+prettyjws"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"

IMAGE_MANIFESTS = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEXES = (OCI_INDEX, DOCKER_MANIFEST_LIST)
ACCEPT = ", ".join((OCI_INDEX, DOCKER_MANIFEST_LIST, OCI_MANIFEST, DOCKER_MANIFEST))

MAX_MANIFEST_BYTES = 4 << 20
MAX_CONFIG_BYTES = 16 << 20
CHUNK = 256 << 10

_DIGEST_RE = re.compile(r"^(sha256|sha512):([0-9a-f]+)$")


class DigestMismatch(BadGateway):
    """Content from a registry does not hash to the digest that names it."""


def compute_digest(data: bytes, algo: str = "sha256") -> str:
    return f"{algo}:{hashlib.new(algo, data).hexdigest()}"


def digest_algo(digest: str) -> str:
    m = _DIGEST_RE.match(digest)
    if not m:
        raise BadGateway(f"unsupported digest {digest!r}")
    return m.group(1)


# --- platforms ---
@dataclass(frozen=True)
class Platform:
    os: str
    architecture: str
    variant: str | None = None

    def __str__(self) -> str:
        s = f"{self.os}/{self.architecture}"
        return f"{s}/{self.variant}" if self.variant else s

    @classmethod
    def parse(cls, text: str) -> Platform:
        parts = text.strip().lower().split("/")
        if len(parts) == 1:
            parts = ["linux", parts[0]]
        if len(parts) not in (2, 3) or not all(parts):
            raise BadRequest(f"invalid platform {text!r} (want os/arch[/variant])")
        os_, arch = parts[0], _ARCH_ALIASES.get(parts[1], parts[1])
        return cls(os_, arch, parts[2] if len(parts) == 3 else None)

    @classmethod
    def host(cls) -> Platform:
        machine = _platform.machine().lower()
        arch, variant = _MACHINES.get(machine, (machine, None))
        return cls("linux", arch, variant)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Platform:
        return cls(
            str(obj.get("os", "")),
            str(obj.get("architecture", "")),
            obj.get("variant") or None,
        )


_ARCH_ALIASES = {"x86_64": "amd64", "x86-64": "amd64", "aarch64": "arm64", "i386": "386"}
_MACHINES: dict[str, tuple[str, str | None]] = {
    "x86_64": ("amd64", None),
    "amd64": ("amd64", None),
    "aarch64": ("arm64", "v8"),
    "arm64": ("arm64", "v8"),
    "armv7l": ("arm", "v7"),
    "armv6l": ("arm", "v6"),
    "i386": ("386", None),
    "i686": ("386", None),
    "ppc64le": ("ppc64le", None),
    "s390x": ("s390x", None),
    "riscv64": ("riscv64", None),
}
# The variant an entry without one is taken to have.
_DEFAULT_VARIANT = {"arm64": "v8", "arm": "v7"}


def platform_score(want: Platform, have: Platform) -> int | None:
    """How well an index entry's platform fits: None if not at all, higher is better."""
    if have.os != want.os or have.architecture != want.architecture:
        return None
    default = _DEFAULT_VARIANT.get(want.architecture)
    want_v = want.variant or default
    have_v = have.variant or default
    if want_v == have_v:
        return 2 if have.variant == want.variant else 1
    if want.variant is None:
        return 0  # no preference stated: any variant will do, after the better ones
    return None


# --- descriptors and manifests ---
@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: Platform | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Descriptor:
        try:
            digest = str(obj["digest"])
            size = int(obj["size"])
        except (KeyError, TypeError, ValueError):
            raise BadGateway(f"malformed descriptor in manifest: {obj!r}") from None
        digest_algo(digest)
        plat = obj.get("platform")
        return cls(
            media_type=str(obj.get("mediaType", "")),
            digest=digest,
            size=size,
            platform=Platform.from_json(plat) if isinstance(plat, Mapping) else None,
            annotations=dict(obj.get("annotations") or {}),
        )


@dataclass(frozen=True)
class Manifest:
    media_type: str
    digest: str
    raw: bytes
    body: Mapping[str, Any]

    @property
    def is_index(self) -> bool:
        return self.media_type in INDEXES

    @property
    def entries(self) -> list[Descriptor]:
        return [Descriptor.from_json(m) for m in self.body.get("manifests") or []]

    @property
    def config(self) -> Descriptor:
        cfg = self.body.get("config")
        if not isinstance(cfg, Mapping):
            raise BadGateway(f"manifest {self.digest} has no config")
        return Descriptor.from_json(cfg)

    @property
    def layers(self) -> list[Descriptor]:
        """Layer descriptors, bottom first (as in the manifest)."""
        return [Descriptor.from_json(m) for m in self.body.get("layers") or []]


@dataclass(frozen=True)
class ResolvedImage:
    reference: Reference
    digest: str  # what the reference resolved to (the index's digest for multi-platform)
    manifest: Manifest  # the image manifest (for the selected platform)
    platform: Platform | None  # the selected platform, when chosen from an index


# --- credentials ---
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


# --- WWW-Authenticate ---
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


def _registry_errors(resp_body: bytes) -> list[dict[str, Any]]:
    try:
        data = json.loads(resp_body)
    except ValueError:
        return []
    errs = data.get("errors") if isinstance(data, dict) else None
    return [e for e in errs if isinstance(e, dict)] if isinstance(errs, list) else []


def _summary(errors: list[dict[str, Any]], body: bytes) -> str:
    if errors:
        return "; ".join(f"{e.get('code', '?')}: {e.get('message', '')}".strip() for e in errors)
    return body[:200].decode("utf-8", "replace").strip()


class RegistryClient:
    """One client per pull (or longer): it caches tokens and reuses connections."""

    def __init__(
        self,
        settings: RegistrySettings | None = None,
        *,
        credentials: Mapping[str, str | tuple[str, str] | Credential] | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings: RegistrySettings = settings or ImageSettings()
        self.retries = retries
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            follow_redirects=True,
            transport=transport,
            headers={"User-Agent": "aenv"},
        )
        self._insecure = {normalize_registry(h) for h in self.settings.insecure_registries}
        creds: dict[str, Credential] = {}
        path = self.settings.docker_config or default_docker_config()
        creds.update(load_docker_config(path))
        for host, value in self.settings.registry_credentials.items():
            creds[normalize_registry(host)] = parse_credentials(value)
        for host, given in (credentials or {}).items():
            creds[normalize_registry(host)] = parse_credentials(given)
        self._creds = creds
        self._challenges: dict[str, Challenge] = {}
        self._tokens: dict[tuple[str, str], _Token] = {}
        self._auth_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._pinged: set[str] = set()

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # --- addressing ---
    def base_url(self, registry: str) -> str:
        registry = normalize_registry(registry)
        host = "registry-1.docker.io" if registry == DOCKER_HUB else registry
        scheme = "http" if registry in self._insecure else "https"
        return f"{scheme}://{host}"

    def credential(self, registry: str) -> Credential | None:
        return self._creds.get(normalize_registry(registry))

    # --- auth ---
    async def _token(self, registry: str, scope: str, challenge: Challenge) -> _Token:
        key = (registry, scope)
        lock = self._auth_locks.setdefault(key, asyncio.Lock())
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
                    f"token service {realm} of registry {registry} unreachable: {_exc_text(e)}"
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

    async def _auth_header(
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

    # --- requests ---
    async def ping(self, registry: str) -> None:
        """`GET /v2/`: checks that the registry is reachable and speaks the v2 API; learns
        its auth challenge."""
        registry = normalize_registry(registry)
        if registry in self._pinged:
            return
        url = f"{self.base_url(registry)}/v2/"
        resp = await self._send_retrying(registry, "GET", url, {}, what=f"registry {registry}")
        try:
            if resp.status_code == 401:
                challenge = parse_challenge(resp.headers.get("www-authenticate", ""))
                if challenge is None:
                    raise BadGateway(f"registry {registry} returned 401 without a challenge")
                self._challenges[registry] = challenge
            elif resp.status_code == 404:
                raise BadGateway(f"{url} is not an OCI registry (GET /v2/ returned 404)")
            elif resp.status_code >= 400:
                body = await resp.aread()
                raise BadGateway(
                    f"registry {registry} failed with {resp.status_code}: {body[:200]!r}"
                )
        finally:
            await resp.aclose()
        self._pinged.add(registry)

    async def _send_retrying(
        self, registry: str, method: str, url: str, headers: Mapping[str, str], *, what: str
    ) -> httpx.Response:
        """Sends (streaming), retrying transport errors and 502/503/504 with backoff."""
        delay = 0.2
        for attempt in range(self.retries + 1):
            req = self._http.build_request(method, url, headers=dict(headers))
            try:
                resp = await self._http.send(req, stream=True)
            except httpx.TransportError as e:
                if attempt >= self.retries:
                    raise Unavailable(
                        f"registry {registry} unreachable: {_exc_text(e)}",
                        error_code="registry_unreachable",
                    ) from e
            else:
                if resp.status_code not in (502, 503, 504) or attempt >= self.retries:
                    return resp
                await resp.aclose()
            await asyncio.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    async def _open(
        self,
        ref: Reference,
        path: str,
        *,
        headers: Mapping[str, str] | None = None,
        what: str,
        ok: tuple[int, ...] = (200,),
    ) -> httpx.Response:
        """A streaming response for `/v2/<repository><path>` with auth; raises mapped
        errors for any status not in `ok`. The caller closes the response."""
        registry = ref.registry
        await self.ping(registry)
        scope = f"repository:{ref.repository}:pull"
        url = f"{self.base_url(registry)}/v2/{ref.repository}{path}"
        auth, anonymous = await self._auth_header(registry, scope)
        for attempt in range(2):
            h = dict(headers or {})
            if auth:
                h["Authorization"] = auth
            resp = await self._send_retrying(registry, "GET", url, h, what=what)
            if resp.status_code == 401 and attempt == 0:
                challenge = parse_challenge(resp.headers.get("www-authenticate", ""))
                await resp.aclose()
                if challenge is not None and (auth is None or challenge.scheme == "bearer"):
                    self._challenges[registry] = challenge
                    auth, anonymous = await self._auth_header(registry, scope, refresh=True)
                    continue
                cred = self.credential(registry)
                if cred is not None and auth is not None and auth.startswith("Basic "):
                    raise Unauthorized(
                        f"bad credentials for registry {registry} (user {cred.username!r})",
                        error_code="bad_credentials",
                    )
                raise self._denied(ref, what, anonymous, [])
            if resp.status_code in ok:
                return resp
            body = await _read_capped(resp, 64 << 10)
            await resp.aclose()
            raise self._error(ref, what, resp.status_code, body, anonymous)
        raise AssertionError("unreachable")

    def _denied(
        self, ref: Reference, what: str, anonymous: bool, errors: list[dict[str, Any]]
    ) -> AenvError:
        detail = f" ({_summary(errors, b'')})" if errors else ""
        if anonymous:
            # Docker Hub answers 401 for repositories that do not exist as well.
            return NotFound(
                f"{what} not found in registry {ref.registry}, or it is private "
                f"and needs credentials{detail}",
                error_code="image_not_found",
            )
        return Unauthorized(
            f"credentials for registry {ref.registry} were refused for {what}{detail}",
            error_code="bad_credentials",
        )

    def _error(
        self, ref: Reference, what: str, status: int, body: bytes, anonymous: bool
    ) -> AenvError:
        errors = _registry_errors(body)
        codes = {str(e.get("code", "")).upper() for e in errors}
        if status == 404 or codes & {"MANIFEST_UNKNOWN", "NAME_UNKNOWN", "BLOB_UNKNOWN"}:
            return NotFound(
                f"{what} not found in registry {ref.registry}", error_code="image_not_found"
            )
        if status == 401:
            return self._denied(ref, what, anonymous, errors)
        if status == 403:
            return Forbidden(
                f"registry {ref.registry} denied access to {what}: {_summary(errors, body)}",
                error_code="access_denied",
            )
        if status == 429:
            return TooManyRequests(
                f"registry {ref.registry} rate limit reached: {_summary(errors, body)}"
            )
        if status >= 500:
            return BadGateway(
                f"registry {ref.registry} failed with {status} for {what}: {_summary(errors, body)}"
            )
        return BadGateway(
            f"registry {ref.registry} answered {status} for {what}: {_summary(errors, body)}"
        )

    # --- manifests ---
    async def get_manifest(self, ref: Reference, reference: str | None = None) -> Manifest:
        """Fetches a manifest or index by tag or digest and checks its digest."""
        reference = reference or ref.reference
        what = (
            f"image {ref.familiar}"
            if reference == ref.reference
            else f"manifest {reference} of {ref.familiar}"
        )
        resp = await self._open(
            ref, f"/manifests/{reference}", headers={"Accept": ACCEPT}, what=what
        )
        try:
            raw = await _read_capped(resp, MAX_MANIFEST_BYTES + 1)
        finally:
            await resp.aclose()
        if len(raw) > MAX_MANIFEST_BYTES:
            raise BadGateway(
                f"manifest of {ref.familiar} is larger than {MAX_MANIFEST_BYTES} bytes"
            )
        is_digest = bool(_DIGEST_RE.match(reference))
        algo = digest_algo(reference) if is_digest else "sha256"
        digest = compute_digest(raw, algo)
        if is_digest and digest != reference:
            raise DigestMismatch(
                f"manifest {reference} of {ref.familiar} from registry {ref.registry} "
                f"failed verification: content hashes to {digest}",
                error_code="digest_mismatch",
            )
        header = resp.headers.get("docker-content-digest", "")
        if not is_digest and header.startswith("sha256:") and header != digest:
            raise DigestMismatch(
                f"manifest of {ref.familiar} from registry {ref.registry} failed verification: "
                f"registry says {header}, content hashes to {digest}",
                error_code="digest_mismatch",
            )
        try:
            body = json.loads(raw)
        except ValueError:
            raise BadGateway(f"manifest of {ref.familiar} is not JSON") from None
        if not isinstance(body, dict):
            raise BadGateway(f"manifest of {ref.familiar} is not a JSON object")
        media_type = str(body.get("mediaType") or "")
        if not media_type:
            ctype = resp.headers.get("content-type", "").split(";")[0].strip()
            if ctype in IMAGE_MANIFESTS + INDEXES:
                media_type = ctype
            elif "manifests" in body:
                media_type = OCI_INDEX
            elif "layers" in body:
                media_type = OCI_MANIFEST
        if media_type in (DOCKER_SCHEMA1, DOCKER_SCHEMA1_SIGNED) or body.get("schemaVersion") == 1:
            raise BadRequest(
                f"image {ref.familiar} uses the deprecated Docker schema 1 manifest format, "
                "which aenv does not pull",
                error_code="unsupported_manifest",
            )
        if media_type not in IMAGE_MANIFESTS + INDEXES:
            raise BadRequest(
                f"image {ref.familiar} has an unsupported manifest type {media_type!r}",
                error_code="unsupported_manifest",
            )
        return Manifest(media_type, digest, raw, body)

    async def resolve(self, ref: Reference, platform: Platform | None = None) -> ResolvedImage:
        """The image manifest for `ref`, selecting `platform` (default: the configured or
        host platform) from a multi-platform index."""
        top = await self.get_manifest(ref)
        if not top.is_index:
            return ResolvedImage(ref, top.digest, top, None)
        want = platform or self.default_platform()
        entry, chosen = select_platform(top, want, ref)
        manifest = await self.get_manifest(ref, entry.digest)
        if manifest.is_index:
            raise BadRequest(f"image {ref.familiar}: nested indexes are not supported")
        return ResolvedImage(ref, top.digest, manifest, chosen)

    def default_platform(self) -> Platform:
        configured = self.settings.pull_platform
        return Platform.parse(configured) if configured else Platform.host()

    # --- blobs ---
    async def get_blob(
        self, ref: Reference, desc: Descriptor, max_size: int = MAX_CONFIG_BYTES
    ) -> bytes:
        """A small blob (an image config), whole and verified."""
        if desc.size > max_size:
            raise BadGateway(
                f"blob {desc.digest} of {ref.familiar} is too large ({desc.size} bytes)"
            )
        what = f"blob {desc.digest} of image {ref.familiar}"
        resp = await self._open(ref, f"/blobs/{desc.digest}", what=what)
        try:
            data = await _read_capped(resp, max_size + 1)
        finally:
            await resp.aclose()
        got = compute_digest(data, digest_algo(desc.digest))
        if got != desc.digest or len(data) != desc.size:
            raise DigestMismatch(
                f"{what} from registry {ref.registry} failed verification: "
                f"got {got} ({len(data)} bytes), expected {desc.size} bytes",
                error_code="digest_mismatch",
            )
        return data

    async def iter_blob(
        self, ref: Reference, desc: Descriptor, offset: int = 0
    ) -> AsyncIterator[bytes]:
        """The bytes of a blob from `offset` on, in chunks. A dropped transfer is resumed
        with `Range: bytes=<n>-` (or, if the registry ignores ranges, by skipping what was
        already received), up to `retries` times in a row. Never yields more than
        `desc.size` bytes in total; the caller verifies the digest."""
        pos = offset
        failures = 0
        what = f"layer {desc.digest} of image {ref.familiar}"
        while pos < desc.size:
            headers = {"Accept-Encoding": "identity"}
            if pos:
                headers["Range"] = f"bytes={pos}-"
            resp = await self._open(
                ref, f"/blobs/{desc.digest}", headers=headers, what=what, ok=(200, 206, 416)
            )
            try:
                skip = 0
                if resp.status_code == 416:
                    raise BadGateway(f"registry {ref.registry} refused range {pos}- of {what}")
                if pos and resp.status_code == 200:
                    skip = pos  # no range support: read again from the start
                elif resp.status_code == 206:
                    start = _content_range_start(resp.headers.get("content-range", ""))
                    if start != pos:
                        raise BadGateway(
                            f"registry {ref.registry} answered range {pos}- of {what} with "
                            f"{resp.headers.get('content-range')!r}"
                        )
                # Raw: a Content-Encoding from a CDN must not be undone (the digest is over
                # the blob as stored); unchunked, so a drop loses nothing already received.
                async for chunk in resp.aiter_raw():
                    if skip:
                        if len(chunk) <= skip:
                            skip -= len(chunk)
                            continue
                        chunk = chunk[skip:]
                        skip = 0
                    room = desc.size - pos
                    if len(chunk) > room:
                        raise DigestMismatch(
                            f"{what} from registry {ref.registry} is larger than the "
                            f"{desc.size} bytes its manifest states",
                            error_code="digest_mismatch",
                        )
                    pos += len(chunk)
                    failures = 0
                    yield chunk
                if pos < desc.size:
                    raise httpx.RemoteProtocolError("transfer ended early")
                return
            except httpx.TransportError as e:
                failures += 1
                if failures > self.retries:
                    raise Unavailable(
                        f"download of {what} from registry {ref.registry} failed at byte "
                        f"{pos} of {desc.size}: {_exc_text(e)}",
                        error_code="registry_unreachable",
                    ) from e
                log.info("resuming %s at byte %d after: %s", what, pos, _exc_text(e))
                await asyncio.sleep(0.2 * 2**failures)
            finally:
                await resp.aclose()


def select_platform(index: Manifest, want: Platform, ref: Reference) -> tuple[Descriptor, Platform]:
    best: tuple[int, Descriptor, Platform] | None = None
    available: list[str] = []
    for entry in index.entries:
        plat = entry.platform
        if plat is None or plat.os == "unknown" or entry.media_type not in IMAGE_MANIFESTS + ("",):
            continue  # attestation manifests and the like
        available.append(str(plat))
        score = platform_score(want, plat)
        if score is not None and (best is None or score > best[0]):
            best = (score, entry, plat)
    if best is None:
        raise NotFound(
            f"image {ref.familiar} has no variant for platform {want} "
            f"(available: {', '.join(available) or 'none'})",
            error_code="platform_not_found",
        )
    return best[1], best[2]


def _content_range_start(value: str) -> int | None:
    m = re.match(r"^\s*bytes\s+(\d+)-", value)
    return int(m.group(1)) if m else None


async def _read_capped(resp: httpx.Response, limit: int) -> bytes:
    buf = bytearray()
    async for chunk in resp.aiter_bytes():
        buf += chunk
        if len(buf) >= limit:
            break
    return bytes(buf[:limit])


def _exc_text(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, httpx.ConnectError) and ("SSL" in text or "certificate" in text):
        text += " (if this registry speaks plain HTTP, list it in AENV_INSECURE_REGISTRIES)"
    return text
