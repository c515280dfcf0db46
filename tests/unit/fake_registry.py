"""An in-process fake OCI registry (httpx MockTransport) for the registry client's and the
pull's unit tests: manifests, blobs and layers it serves, the auth it asks for, the faults it
injects (dropped connections, no Range support), and a client pointed at it.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from aenv.config import ImageSettings
from aenv.images.manifests import OCI_MANIFEST
from aenv.images.reference import parse_reference
from aenv.images.registry import RegistryClient

REG = "reg.test:5000"


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def layer_tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class _Body(httpx.AsyncByteStream):
    def __init__(self, data: bytes, fail_after: int | None) -> None:
        self.data = data
        self.fail_after = fail_after

    async def __aiter__(self) -> AsyncIterator[bytes]:
        step = 4096
        for i in range(0, len(self.data), step):
            if self.fail_after is not None and i >= self.fail_after:
                raise httpx.ReadError("connection reset by peer")
            yield self.data[i : i + step]


@dataclass
class FakeRegistry:
    """Serves one repository; optional Bearer or Basic auth, failure injection."""

    auth: str | None = None  # None | "bearer" | "basic"
    user: tuple[str, str] = ("alice", "secret")
    anonymous_token: bool = True
    ranges: bool = True
    manifests: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # ref -> (type, body)
    blobs: dict[str, bytes] = field(default_factory=dict)
    fail_blob_after: dict[str, list[int]] = field(default_factory=dict)  # digest -> offsets
    status_override: dict[str, int] = field(default_factory=dict)  # path -> status
    requests: list[httpx.Request] = field(default_factory=list)
    tokens_issued: int = 0

    def add_blob(self, data: bytes) -> str:
        d = sha(data)
        self.blobs[d] = data
        return d

    def add_manifest(self, tag: str | None, media_type: str, body: dict[str, Any]) -> str:
        raw = json.dumps(body).encode()
        d = sha(raw)
        self.manifests[d] = (media_type, raw)
        if tag:
            self.manifests[tag] = (media_type, raw)
        return d

    def add_image(self, tag: str | None, layers: list[bytes], arch: str = "amd64") -> str:
        diff_ids = [sha(gzip.decompress(b)) for b in layers]
        config = json.dumps(
            {
                "architecture": arch,
                "os": "linux",
                "config": {"Env": ["PATH=/bin", "A=1"], "Cmd": ["sh"], "WorkingDir": "/w"},
                "rootfs": {"type": "layers", "diff_ids": diff_ids},
            }
        ).encode()
        cd = self.add_blob(config)
        descs = []
        for b in layers:
            descs.append(
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": self.add_blob(b),
                    "size": len(b),
                }
            )
        return self.add_manifest(
            tag,
            OCI_MANIFEST,
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {
                    "mediaType": "application/vnd.oci.image.config.v1+json",
                    "digest": cd,
                    "size": len(config),
                },
                "layers": descs,
            },
        )

    def _authorized(self, request: httpx.Request) -> bool:
        h = request.headers.get("authorization", "")
        if self.auth is None:
            return True
        if self.auth == "basic":
            want = base64.b64encode(f"{self.user[0]}:{self.user[1]}".encode()).decode()
            return h == f"Basic {want}"
        return h in ("Bearer good-token", "Bearer anon-token") and (
            h == "Bearer good-token" or "pull" in self._anon_scope
        )

    _anon_scope = ""

    def _challenge(self) -> dict[str, str]:
        if self.auth == "basic":
            return {"www-authenticate": 'Basic realm="fake"'}
        return {
            "www-authenticate": f'Bearer realm="https://auth.test/token",service="{REG}",'
            'scope="repository:app:pull"'
        }

    async def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        url = request.url
        if url.host == "auth.test":
            return self._token(request)
        path = url.path
        if path in self.status_override:
            code = self.status_override[path]
            return httpx.Response(
                code, json={"errors": [{"code": "X", "message": f"status {code}"}]}
            )
        if not self._authorized(request):
            return httpx.Response(
                401,
                headers=self._challenge(),
                json={"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]},
            )
        if path == "/v2/":
            return httpx.Response(200, json={})
        if path.startswith("/v2/app/manifests/"):
            ref = path.rsplit("/", 1)[1]
            if ref not in self.manifests:
                return httpx.Response(
                    404,
                    json={"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]},
                )
            mt, raw = self.manifests[ref]
            return httpx.Response(
                200, content=raw, headers={"content-type": mt, "docker-content-digest": sha(raw)}
            )
        if path.startswith("/v2/app/blobs/"):
            d = path.rsplit("/", 1)[1]
            if d not in self.blobs:
                return httpx.Response(404, json={"errors": [{"code": "BLOB_UNKNOWN"}]})
            data = self.blobs[d]
            start = 0
            status = 200
            rng = request.headers.get("range")
            if rng and self.ranges:
                start = int(rng.split("=")[1].split("-")[0])
                status = 206
            fails = self.fail_blob_after.get(d) or []
            fail_after = fails.pop(0) - start if fails else None
            body = data[start:]
            headers = {"content-length": str(len(body))}
            if status == 206:
                headers["content-range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return httpx.Response(status, headers=headers, stream=_Body(body, fail_after))
        return httpx.Response(404, json={"errors": [{"code": "NAME_UNKNOWN"}]})

    def _token(self, request: httpx.Request) -> httpx.Response:
        h = request.headers.get("authorization")
        want = "Basic " + base64.b64encode(f"{self.user[0]}:{self.user[1]}".encode()).decode()
        if h is None:
            if not self.anonymous_token:
                return httpx.Response(401)
            self.tokens_issued += 1
            return httpx.Response(200, json={"token": "anon-token", "expires_in": 300})
        if h != want:
            return httpx.Response(401, json={"details": "bad credentials"})
        assert request.url.params["scope"] == "repository:app:pull"
        assert request.url.params["service"] == REG
        self.tokens_issued += 1
        return httpx.Response(200, json={"access_token": "good-token", "expires_in": 300})


def client_for(reg: FakeRegistry, **kw: Any) -> RegistryClient:
    settings = ImageSettings(
        insecure_registries=[REG], docker_config=Path("/nonexistent/config.json")
    )
    return RegistryClient(settings, transport=httpx.MockTransport(reg.handler), retries=2, **kw)


REF = parse_reference(f"{REG}/app:v1")


def gz_layer(files: dict[str, bytes]) -> bytes:
    return gzip.compress(layer_tar(files))
