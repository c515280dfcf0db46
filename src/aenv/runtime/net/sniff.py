"""The name a client asks for in its first bytes, without terminating anything: the Host
header of an HTTP/1 request, the server name (SNI) of a TLS ClientHello. Pure functions for
the egress proxy (`egress_proxy`).

Each returns `MORE` while the bytes so far end before the answer could be known, else the
name (lower case, no port, no final dot) or None when the data has no name to give (not
HTTP / not TLS, no Host header, no SNI, malformed). The caller bounds how much it reads."""

from __future__ import annotations

import re
from typing import Final, Literal

MORE: Final = "more"
Sniffed = str | None | Literal["more"]

# RFC 7230 token characters of a method.
_METHOD = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_NAME = re.compile(r"[a-z0-9_.-]{1,253}")
TLS_HANDSHAKE = 0x16
CLIENT_HELLO = 1
EXT_SERVER_NAME = 0
HOST_NAME = 0


def _clean(name: str) -> str | None:
    name = name.strip().lower().rstrip(".")
    return name if _NAME.fullmatch(name) else None


def http_host(data: bytes) -> Sniffed:
    """The Host of an HTTP/1.x request whose head starts `data`."""
    head_end = data.find(b"\r\n\r\n")
    head = data if head_end < 0 else data[:head_end]
    lines = head.split(b"\r\n")
    request_line = lines[0]
    if len(lines) == 1 and head_end < 0:
        # Only part of the request line so far: is it still a request line?
        method = request_line.split(b" ", 1)[0]
        if method and not _METHOD.fullmatch(method):
            return None
        return MORE
    parts = request_line.split(b" ")
    if len(parts) != 3 or not _METHOD.fullmatch(parts[0]) or not parts[2].startswith(b"HTTP/"):
        return None
    complete = lines if head_end >= 0 else lines[:-1]  # the last one may be cut short
    for line in complete[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == b"host":
            try:
                text = value.decode("ascii")
            except UnicodeDecodeError:
                return None
            if text.strip().startswith("["):
                return None  # an IPv6 literal: no name
            return _clean(text.rsplit(":", 1)[0] if ":" in text else text)
    return None if head_end >= 0 else MORE


def tls_sni(data: bytes) -> Sniffed:
    """The host_name of the server_name extension of a TLS ClientHello starting `data`.
    The ClientHello must fit its first record (it does for every client in practice: a
    record holds 16 KiB)."""
    if len(data) < 5:
        return MORE if all(a == b for a, b in zip(data, b"\x16\x03", strict=False)) else None
    if data[0] != TLS_HANDSHAKE or data[1] != 3:
        return None
    record_len = int.from_bytes(data[3:5], "big")
    if len(data) < 5 + record_len:
        return MORE
    return _client_hello_sni(data[5 : 5 + record_len])


def _client_hello_sni(msg: bytes) -> str | None:
    if len(msg) < 4 or msg[0] != CLIENT_HELLO:
        return None
    body_len = int.from_bytes(msg[1:4], "big")
    body = msg[4 : 4 + body_len]
    if len(body) < body_len:
        return None  # split over records: not something we follow
    r = _Reader(body)
    r.skip(2 + 32)  # legacy_version, random
    r.skip(r.int(1))  # session id
    r.skip(r.int(2))  # cipher suites
    r.skip(r.int(1))  # compression methods
    if r.at_end():
        return None  # no extensions
    ext = _Reader(r.take(r.int(2)))
    while not ext.at_end():
        kind, data = ext.int(2), ext.take(ext.int(2))
        if kind != EXT_SERVER_NAME:
            continue
        names = _Reader(data)
        names = _Reader(names.take(names.int(2)))
        while not names.at_end():
            name_type, name = names.int(1), names.take(names.int(2))
            if name_type == HOST_NAME:
                try:
                    return _clean(name.decode("ascii"))
                except UnicodeDecodeError:
                    return None
        return None
    return None


class _Reader:
    """Bounds-checked reads; a short read marks it broken and yields nothing more."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.ok = data, 0, True

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            self.ok, self.pos = False, len(self.data)
            return b""
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def skip(self, n: int) -> None:
        self.take(n)

    def int(self, n: int) -> int:
        raw = self.take(n)
        return int.from_bytes(raw, "big") if len(raw) == n else 0

    def at_end(self) -> bool:
        return self.pos >= len(self.data)
