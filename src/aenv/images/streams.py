"""The byte side of a layer blob: compression detection and the reader chain.

    live bytes (after replayed ones) ─► `BlobSource`: blob digest, size cap, tee into the
    partial download ─► `GzipReader` | `ZstdReader` | plain ─► `HashReader`: diff_id ─► tar

Every reader is file-like (`read(n)`), synchronous, and bounds what one read returns, so the
chain runs in one worker thread with constant memory whatever the layer's size.
"""

from __future__ import annotations

import hashlib
import logging
import zlib
from typing import IO, BinaryIO, Literal, Protocol, cast

import zstandard

from ..errors import BadRequest
from .manifests import DigestMismatch

log = logging.getLogger("aenv.images")

Compression = Literal["gzip", "zstd", "none"]

CHUNK = 1 << 20
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class InvalidLayer(BadRequest):
    """A layer blob is malformed or unsafe (bad compression, bad tar, escaping paths)."""


class Reader(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


def compression_from_media_type(media_type: str | None) -> Compression | None:
    mt = (media_type or "").lower()
    if mt.endswith("+gzip") or mt.endswith(".tar.gzip") or mt.endswith(".gzip"):
        return "gzip"
    if mt.endswith("+zstd") or mt.endswith(".zstd"):
        return "zstd"
    if mt.endswith(".tar") or mt.endswith("diff.tar"):
        return "none"
    return None


def detect_compression(head: bytes, media_type: str | None = None) -> Compression:
    """By magic bytes; the media type only breaks ties for blobs too short to tell."""
    if head.startswith(GZIP_MAGIC):
        found: Compression = "gzip"
    elif head.startswith(ZSTD_MAGIC):
        found = "zstd"
    elif len(head) < 4 and compression_from_media_type(media_type):
        return compression_from_media_type(media_type) or "none"
    else:
        found = "none"
    declared = compression_from_media_type(media_type)
    if declared and declared != found:
        log.warning("layer declared as %s (%s) is %s; using %s", declared, media_type, found, found)
    return found


class BlobSource:
    """The compressed stream: replayed bytes first, then live ones. Hashes everything,
    copies live bytes into `tee`, refuses to read past `limit`."""

    def __init__(
        self,
        live: Reader,
        *,
        algo: str,
        limit: int | None,
        replay: Reader | None,
        tee: BinaryIO | None,
    ) -> None:
        self._live = live
        self._replay = replay
        self._tee = tee
        self._limit = limit
        self._hash = hashlib.new(algo)
        self._algo = algo
        self._pushback = b""
        self.count = 0

    def _next(self, n: int) -> bytes:
        if self._replay is not None:
            data = self._replay.read(n)
            if data:
                return data
            self._replay = None
        data = self._live.read(n)
        if data and self._tee is not None:
            self._tee.write(data)
        return data

    def read(self, n: int = -1, /) -> bytes:
        if n is None or n < 0:
            n = CHUNK
        if self._pushback:
            data, self._pushback = self._pushback[:n], self._pushback[n:]
            return data
        data = self._next(n)
        if data:
            self.count += len(data)
            if self._limit is not None and self.count > self._limit:
                raise DigestMismatch(
                    f"layer is larger than the {self._limit} bytes its manifest states",
                    error_code="digest_mismatch",
                )
            self._hash.update(data)
        return data

    def peek(self, n: int) -> bytes:
        while len(self._pushback) < n:
            data = self.read(n - len(self._pushback))
            if not data:
                break
            self._pushback += data
        return self._pushback[:n]

    def drain(self) -> None:
        while self.read(CHUNK):
            pass

    def digest(self) -> str:
        return f"{self._algo}:{self._hash.hexdigest()}"


class GzipReader:
    """gzip (also multi-member) decompression with bounded output per read."""

    def __init__(self, raw: Reader) -> None:
        self._raw = raw
        self._buf = b""
        self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self._in_member = False

    def read(self, n: int = -1, /) -> bytes:
        if n is None or n < 0:
            n = CHUNK
        n = max(n, 1)
        while True:
            if not self._buf:
                self._buf = self._raw.read(CHUNK)
                if not self._buf:
                    if self._in_member:
                        raise InvalidLayer("gzip stream ends early")
                    return b""
            if not self._in_member:
                self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)
                self._in_member = True
            try:
                out = self._d.decompress(self._buf, n)
            except zlib.error as e:
                raise InvalidLayer(f"corrupt gzip data: {e}") from None
            if self._d.eof:
                self._buf = self._d.unused_data
                self._in_member = False
            else:
                self._buf = self._d.unconsumed_tail
            if out:
                return out


class ZstdReader:
    def __init__(self, raw: Reader) -> None:
        self._r = zstandard.ZstdDecompressor().stream_reader(
            cast(IO[bytes], raw), read_size=CHUNK, read_across_frames=True, closefd=False
        )

    def read(self, n: int = -1, /) -> bytes:
        if n is None or n < 0:
            n = CHUNK
        try:
            return self._r.read(n)
        except zstandard.ZstdError as e:
            raise InvalidLayer(f"corrupt zstd data: {e}") from None


class HashReader:
    """Hashes (the diff_id) and counts what passes through."""

    def __init__(self, raw: Reader) -> None:
        self._raw = raw
        self._hash = hashlib.sha256()
        self.count = 0

    def read(self, n: int = -1, /) -> bytes:
        data = self._raw.read(n)
        if data:
            self._hash.update(data)
            self.count += len(data)
        return data

    def drain(self) -> None:
        while self.read(CHUNK):
            pass

    def digest(self) -> str:
        return f"sha256:{self._hash.hexdigest()}"
