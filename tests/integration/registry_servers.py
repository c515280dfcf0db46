"""Local registries for the tests that pull: Debian's `docker-registry` on loopback, open or
behind token auth, with the token server (a small HTTP server here that signs RS256 JWTs with
a key generated for the session), and pushing an OCI layout to a registry with skopeo.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from tests.helpers import free_port, wait_healthy

from .oci_layouts import REGISTRY_BIN, SKOPEO, Layout


# --- token auth ---
def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    """Issues registry tokens (RS256 JWTs) like a real token service: Basic credentials
    get pull access; anonymous callers get a token without access (or a 401 when
    `allow_anonymous` is off)."""

    def __init__(self, workdir: Path, users: dict[str, str]) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import padding, rsa
        from cryptography.x509.oid import NameOID

        self.users = users
        self.allow_anonymous = True
        self.service = "aenv-test-registry"
        self.issuer = "aenv-test-issuer"
        self.requests: list[dict[str, Any]] = []
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aenv test token issuer")])
        now = datetime.now(UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(days=1))
            .not_valid_after(now + timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        self.cert_path = workdir / "token-ca.pem"
        self.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        # libtrust's key id, which docker-registry uses to find the key for a `kid`.
        spki = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        b32 = base64.b32encode(hashlib.sha256(spki).digest()[:30]).decode().rstrip("=")
        self.kid = ":".join(b32[i : i + 4] for i in range(0, len(b32), 4))

        def sign(data: bytes) -> bytes:
            return key.sign(data, padding.PKCS1v15(), hashes.SHA256())

        self._sign = sign
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer._handle(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/token"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def jwt(self, subject: str, access: list[dict[str, Any]]) -> str:
        header = {"typ": "JWT", "alg": "RS256", "kid": self.kid}
        now = int(time.time())
        claims = {
            "iss": self.issuer,
            "sub": subject,
            "aud": self.service,
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": uuid.uuid4().hex,
            "access": access,
        }
        signing_input = (
            _b64url(json.dumps(header).encode()) + "." + _b64url(json.dumps(claims).encode())
        )
        return signing_input + "." + _b64url(self._sign(signing_input.encode()))

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        query = parse_qs(urlparse(h.path).query)
        auth = h.headers.get("Authorization", "")
        self.requests.append({"query": query, "auth": bool(auth)})
        user = ""
        access: list[dict[str, Any]] = []
        if auth.startswith("Basic "):
            user, _, pw = base64.b64decode(auth[6:]).decode().partition(":")
            if self.users.get(user) != pw:
                self._reply(h, 401, {"details": "invalid credentials"})
                return
            for scope in query.get("scope", []):
                kind, name, actions = scope.split(":")
                access.append({"type": kind, "name": name, "actions": actions.split(",")})
        elif not self.allow_anonymous:
            self._reply(h, 401, {"details": "authentication required"})
            return
        token = self.jwt(user, access)
        self._reply(h, 200, {"token": token, "access_token": token, "expires_in": 300})

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# --- registries ---
@dataclass
class Registry:
    host: str  # 127.0.0.1:port
    storage: Path
    proc: subprocess.Popen[bytes]
    log: Path
    pushed: dict[str, Layout] = field(default_factory=dict)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_registry(workdir: Path, storage: Path, auth: dict[str, Any] | None = None) -> Registry:
    port = free_port()
    config: dict[str, Any] = {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}", "secret": uuid.uuid4().hex},
    }
    if auth:
        config["auth"] = auth
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "config.yml"
    cfg.write_text(json.dumps(config))  # JSON is YAML
    log = workdir / "registry.log"
    proc = subprocess.Popen(
        [REGISTRY_BIN, "serve", str(cfg)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    reg = Registry(f"127.0.0.1:{port}", storage, proc, log)
    try:
        wait_healthy(f"http://{reg.host}", 20, proc=proc, path="/v2/", status=(200, 401), log=log)
    except AssertionError:
        reg.stop()
        raise
    return reg


def push(layout: Layout, tag: str, registry: Registry, name: str, *extra: str) -> None:
    assert SKOPEO is not None
    cmd = [
        SKOPEO,
        "--insecure-policy",
        "copy",
        "--quiet",
        "--dest-tls-verify=false",
        *extra,
        f"oci:{layout.root}:{tag}",
        f"docker://{registry.host}/{name}:{tag}",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"
