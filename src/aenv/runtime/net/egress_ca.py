"""The egress proxy's certificate authority: what lets it terminate a sandbox's HTTPS to a
host with header `rules` (`egress_intercept`) and still be trusted inside.

One CA per node, made at the first start under `$AENV_HOME/secrets/egress-ca/` (its key
0600, like the rest of that directory); its certificate goes into the trust stores of the
sandboxes whose egress rules have transforms (`orchestrator/boot.py`), and nowhere else. The
nodes of a cluster (one AENV_SECRETS_KEY) make the same CA key and name from that key, so a
sandbox moved to another node, or made there from a snapshot, still trusts what that node's
proxy presents.
Host certificates are minted on demand, one per host name asked for, signed by it, kept on
disk beside it and in memory; all share one host key, so minting is one signature. EC P-256
throughout: a key is made in a millisecond, and every TLS client of the last decade takes
it.

Upstream, the proxy verifies the real host against the system's trust store plus the
optional `AENV_EGRESS_CA_BUNDLE` (`upstream_context`)."""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import secrets
import ssl
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from aenv.fsutil import write_private

log = logging.getLogger("aenv.runtime")

CA_DAYS = 3650
HOST_DAYS = 30
RENEW_BEFORE = dt.timedelta(days=7)  # a cached host certificate this close to its end is renewed
BACKDATE = dt.timedelta(hours=1)  # clocks inside a restored sandbox may lag a little
ALPN = ["http/1.1"]  # the proxy rewrites HTTP/1 requests: clients fall back to it
_HOST = re.compile(r"[a-z0-9_-][a-z0-9_.-]{0,252}")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{path}: not an EC key")
    return key


def derived_key(seed: bytes) -> ec.EllipticCurvePrivateKey:
    """The same P-256 key from the same seed on every node (HKDF, then the scalar reduced
    into the curve's order)."""
    okm = HKDF(hashes.SHA256(), 48, salt=None, info=b"aenv egress CA key").derive(seed)
    return ec.derive_private_key(int.from_bytes(okm, "big") % (_P256_ORDER - 1) + 1, ec.SECP256R1())


_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


class EgressCA:
    """The node's egress CA and the host certificates it signs. Blocking methods (file and
    crypto work) are for a worker thread; `cached_context` is not blocking."""

    def __init__(
        self, directory: Path, upstream_bundle: Path | None = None, seed: bytes | None = None
    ) -> None:
        self.dir = directory
        self.upstream_bundle = upstream_bundle
        self.seed = seed  # the cluster's secrets key: the CA key is derived from it
        self._lock = threading.Lock()
        self._contexts: dict[str, tuple[ssl.SSLContext, dt.datetime]] = {}
        self._upstream: ssl.SSLContext | None = None
        self._ca_key: ec.EllipticCurvePrivateKey | None = None
        self._ca_cert: x509.Certificate | None = None
        self.pem = b""

    @property
    def _hosts_dir(self) -> Path:
        return self.dir / "hosts"

    def load(self) -> None:
        """Reads the CA, making it (and the host key) the first time. Blocking."""
        key_file, cert_file, host_key = (
            self.dir / "ca.key",
            self.dir / "ca.pem",
            self.dir / "host.key",
        )
        if not (key_file.exists() and cert_file.exists()):
            self._make_ca(key_file, cert_file)
        if not host_key.exists():
            write_private(host_key, _key_pem(ec.generate_private_key(ec.SECP256R1())))
        self._ca_key = _load_key(key_file)
        self._ca_cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        self.pem = cert_file.read_bytes()

    def _make_ca(self, key_file: Path, cert_file: Path) -> None:
        if self.seed is None:
            key = ec.generate_private_key(ec.SECP256R1())
            common_name = f"aenv egress CA {os.uname().nodename}"
        else:
            key = derived_key(self.seed)
            kid = x509.SubjectKeyIdentifier.from_public_key(key.public_key()).digest
            common_name = f"aenv egress CA cluster {kid.hex()[:16]}"
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "aenv"),
                x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64]),
            ]
        )
        now = _now()
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256())
        )
        # The key first: a certificate without its key would be kept and never work.
        write_private(key_file, _key_pem(key))
        write_private(cert_file, cert.public_bytes(serialization.Encoding.PEM))
        log.info("egress CA made in %s", self.dir)

    # Host certificates --------------------------------------------------------------------------

    def cached_context(self, host: str) -> ssl.SSLContext | None:
        """The server context for `host` when one is in memory and not near its end."""
        found = self._contexts.get(host)
        if found is None or found[1] - _now() < RENEW_BEFORE:
            return None
        return found[0]

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a certificate for `host` signed by the CA,
        minted (or read from disk) when needed. Blocking."""
        if not _HOST.fullmatch(host):
            raise ValueError(f"not a host name: {host!r}")
        with self._lock:
            ctx = self.cached_context(host)
            if ctx is not None:
                return ctx
            cert_file = self._hosts_dir / f"{host}.pem"
            expires = self._valid_until(cert_file)
            if expires is None or expires - _now() < RENEW_BEFORE:
                expires = self._mint(host, cert_file)
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(cert_file, self.dir / "host.key")
            ctx.set_alpn_protocols(ALPN)
            self._contexts[host] = (ctx, expires)
            return ctx

    def _valid_until(self, cert_file: Path) -> dt.datetime | None:
        """When a stored host certificate ends, if it is this CA's."""
        try:
            cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        except (FileNotFoundError, ValueError):
            return None
        assert self._ca_cert is not None
        if cert.issuer != self._ca_cert.subject:
            return None
        return cert.not_valid_after_utc

    def _mint(self, host: str, cert_file: Path) -> dt.datetime:
        assert self._ca_key is not None and self._ca_cert is not None
        host_key = _load_key(self.dir / "host.key")
        now = _now()
        end = now + dt.timedelta(days=HOST_DAYS)
        ca_ski = self._ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self._ca_cert.subject)
            .public_key(host_key.public_key())
            .serial_number(int.from_bytes(secrets.token_bytes(16), "big") >> 1)
            .not_valid_before(now - BACKDATE)
            .not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski.value),
                critical=False,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(host_key.public_key()), critical=False
            )
            .sign(self._ca_key, hashes.SHA256())
        )
        write_private(cert_file, cert.public_bytes(serialization.Encoding.PEM))
        log.debug("egress CA signed a certificate for %s", host)
        return end

    # Upstream -----------------------------------------------------------------------------------

    def upstream_context(self) -> ssl.SSLContext:
        """The client context for the real host: the system's CAs (and
        AENV_EGRESS_CA_BUNDLE's), its name checked. Blocking the first time."""
        if self._upstream is None:
            ctx = ssl.create_default_context()
            if self.upstream_bundle is not None:
                ctx.load_verify_locations(cafile=str(self.upstream_bundle))
            ctx.set_alpn_protocols(ALPN)
            self._upstream = ctx
        return self._upstream
