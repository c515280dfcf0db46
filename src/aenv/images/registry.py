"""An async client for OCI distribution (v2) registries: manifests and blobs.

* Transport: HTTPS with certificate verification; plain HTTP only for registries listed in
  `insecure_registries` (`AENV_INSECURE_REGISTRIES`).
* Auth: `auth.RegistryAuth` (anonymous first, then the registry's challenge).
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
import json
import logging
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx

from ..config import ImageSettings
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
from ..registries import DOCKER_HUB, DOCKER_HUB_API, normalize_registry
from .auth import (
    Credential,
    RegistryAuth,
    default_docker_config,
    exc_text,
    load_docker_config,
    parse_challenge,
    parse_credentials,
)
from .manifests import (
    ACCEPT,
    DOCKER_SCHEMA1,
    DOCKER_SCHEMA1_SIGNED,
    IMAGE_MANIFESTS,
    INDEXES,
    OCI_INDEX,
    OCI_MANIFEST,
    Descriptor,
    DigestMismatch,
    Manifest,
    Platform,
    ResolvedImage,
    compute_digest,
    digest_algo,
    is_digest,
    select_platform,
)
from .reference import Reference

log = logging.getLogger("aenv.images")

MAX_MANIFEST_BYTES = 4 << 20
MAX_CONFIG_BYTES = 16 << 20


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
        settings: ImageSettings,
        *,
        credentials: Mapping[str, str | tuple[str, str] | Credential] | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
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
        self._auth = RegistryAuth(self._http, creds)
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
        host = DOCKER_HUB_API if registry == DOCKER_HUB else registry
        scheme = "http" if registry in self._insecure else "https"
        return f"{scheme}://{host}"

    def credential(self, registry: str) -> Credential | None:
        return self._auth.credential(registry)

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
                self._auth.learn(registry, challenge)
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
                        f"registry {registry} unreachable: {exc_text(e)}",
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
        auth, anonymous = await self._auth.header(registry, scope)
        for attempt in range(2):
            h = dict(headers or {})
            if auth:
                h["Authorization"] = auth
            resp = await self._send_retrying(registry, "GET", url, h, what=what)
            if resp.status_code == 401 and attempt == 0:
                challenge = parse_challenge(resp.headers.get("www-authenticate", ""))
                await resp.aclose()
                if challenge is not None and (auth is None or challenge.scheme == "bearer"):
                    self._auth.learn(registry, challenge)
                    auth, anonymous = await self._auth.header(registry, scope, refresh=True)
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
        by_digest = is_digest(reference)
        algo = digest_algo(reference) if by_digest else "sha256"
        digest = compute_digest(raw, algo)
        if by_digest and digest != reference:
            raise DigestMismatch(
                f"manifest {reference} of {ref.familiar} from registry {ref.registry} "
                f"failed verification: content hashes to {digest}",
                error_code="digest_mismatch",
            )
        header = resp.headers.get("docker-content-digest", "")
        if not by_digest and header.startswith("sha256:") and header != digest:
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
                        f"{pos} of {desc.size}: {exc_text(e)}",
                        error_code="registry_unreachable",
                    ) from e
                log.info("resuming %s at byte %d after: %s", what, pos, exc_text(e))
                await asyncio.sleep(0.2 * 2**failures)
            finally:
                await resp.aclose()


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
