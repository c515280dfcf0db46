"""Header transforms at egress: the part of the egress proxy (`egress_proxy`) that opens a
connection to a host with `rules` and sets headers on each of its HTTP/1 requests.

Plain HTTP is read as it is. HTTPS is terminated with a certificate for the host the
ClientHello named, signed by the node's egress CA (`egress_ca`), which the sandbox trusts,
and re-encrypted to the real host (the connection's original destination) with that name
verified against the system's CAs. The sandbox's first bytes were already read to find the
name, so the server side of TLS runs over memory buffers fed those bytes first
(`TlsServerStream`); the upstream side is asyncio's own TLS.

Requests are rewritten one by one (their bodies copied by Content-Length or chunks, so
keep-alive and pipelining work); responses are copied as they come. A request's header
values get their `${e2b.secrets.NAME}` placeholders resolved here, per request, from the
sandbox owner's secrets: the values exist only in this process's memory and on the wire to
the real host, never in a log line (only names are logged). An upgrade (WebSocket) ends the
rewriting: the rest is copied both ways."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from typing import Protocol

from aenv.egress import HeaderMap, UnknownSecret

log = logging.getLogger("aenv.runtime")

CHUNK = 65536
MAX_HEAD = 64 * 1024  # a request head longer than this is refused
HANDSHAKE_TIMEOUT = 10.0

# The headers to set on a request to a host (None: leave the request as it is).
HeadersFor = Callable[[str | None], HeaderMap | None]
# A header value with its placeholders resolved (UnknownSecret for a secret the owner lacks).
Resolve = Callable[[str], str]


class Stream(Protocol):
    async def read(self, n: int) -> bytes: ...
    async def write(self, data: bytes) -> None: ...
    async def write_eof(self) -> None: ...
    def close(self) -> None: ...


class PlainStream:
    """A StreamReader/Writer pair (TLS or not, asyncio's), `prefix` read first."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, prefix: bytes = b""
    ) -> None:
        self.reader, self.writer, self._prefix = reader, writer, prefix

    async def read(self, n: int) -> bytes:
        if self._prefix:
            out, self._prefix = self._prefix[:n], self._prefix[n:]
            return out
        return await self.reader.read(n)

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def write_eof(self) -> None:
        if self.writer.can_write_eof():
            self.writer.write_eof()

    def close(self) -> None:
        self.writer.close()


class TlsServerStream:
    """The server side of TLS over a connection whose first bytes (`initial`, the
    ClientHello) were already read from it."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        ctx: ssl.SSLContext,
        initial: bytes,
    ) -> None:
        self.reader, self.writer = reader, writer
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._in.write(initial)
        self._tls = ctx.wrap_bio(self._in, self._out, server_side=True)

    async def _flush(self) -> None:
        data = self._out.read()
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def _fill(self) -> None:
        data = await self.reader.read(CHUNK)
        if data:
            self._in.write(data)
        else:
            self._in.write_eof()

    async def handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                if self._in.eof:
                    raise ConnectionError("the client closed during the TLS handshake") from None
                await self._fill()
        await self._flush()

    async def read(self, n: int) -> bytes:
        while True:
            try:
                return self._tls.read(n)
            except ssl.SSLWantReadError:
                await self._flush()
                if self._in.eof:
                    return b""
                await self._fill()
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    async def write(self, data: bytes) -> None:
        with contextlib.suppress(ssl.SSLWantReadError):  # TLS 1.3 tickets: written anyway
            self._tls.write(data)
        await self._flush()

    async def write_eof(self) -> None:
        with contextlib.suppress(ssl.SSLError):
            self._tls.unwrap()  # close_notify; the client's own is not waited for
        await self._flush()
        if self.writer.can_write_eof():
            self.writer.write_eof()

    def close(self) -> None:
        self.writer.close()


class _Buffered:
    """Reads of a stream by line and by count."""

    def __init__(self, stream: Stream) -> None:
        self.stream, self.buf = stream, b""

    async def until(self, sep: bytes, limit: int) -> bytes | None:
        """Up to and including `sep`; None at EOF before any byte; ValueError past `limit`."""
        while (i := self.buf.find(sep)) < 0:
            if len(self.buf) > limit:
                raise ValueError("request head too long")
            data = await self.stream.read(CHUNK)
            if not data:
                if self.buf:
                    raise ConnectionError("the client closed in the middle of a request")
                return None
            self.buf += data
        out, self.buf = self.buf[: i + len(sep)], self.buf[i + len(sep) :]
        return out

    async def some(self, n: int) -> bytes:
        if self.buf:
            out, self.buf = self.buf[:n], self.buf[n:]
            return out
        return await self.stream.read(min(n, CHUNK))

    async def copy(self, n: int, to: Stream) -> None:
        while n > 0:
            data = await self.some(n)
            if not data:
                raise ConnectionError("the client closed in the middle of a body")
            await to.write(data)
            n -= len(data)


class Head:
    """A parsed HTTP/1 request head."""

    def __init__(self, raw: bytes) -> None:
        lines = raw.decode("latin-1").split("\r\n")
        self.request_line = lines[0]
        parts = self.request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise ValueError("not an HTTP/1 request")
        self.method = parts[0]
        self.fields: list[tuple[str, str]] = []
        for line in lines[1:]:
            if not line:
                continue
            key, sep, value = line.partition(":")
            if not sep or key != key.strip():
                raise ValueError("malformed header line")
            self.fields.append((key, value.strip()))

    def get(self, name: str) -> str | None:
        return next((v for k, v in self.fields if k.lower() == name), None)

    @property
    def host(self) -> str | None:
        host = self.get("host")
        if host is None or host.startswith("["):
            return None
        return host.rsplit(":", 1)[0].lower().rstrip(".")

    def with_headers(self, headers: HeaderMap, resolve: Resolve) -> bytes:
        """The head with `headers` set (placeholders resolved), replacing the request's own
        of those names."""
        names = {k.lower() for k in headers}
        kept = [(k, v) for k, v in self.fields if k.lower() not in names]
        lines = [self.request_line.encode("latin-1")]
        lines += [f"{k}: {v}".encode("latin-1") for k, v in kept]
        for k, v in headers.items():
            value = resolve(v)
            if any(c in value for c in "\r\n\0"):
                raise ValueError(f"header {k!r}: a secret's value has a line break or NUL")
            lines.append(k.encode("latin-1") + b": " + value.encode())
        return b"\r\n".join(lines) + b"\r\n\r\n"


async def relay_requests(
    client: Stream, upstream: Stream, headers_for: HeadersFor, resolve: Resolve
) -> None:
    """Copies the client's requests to `upstream`, each with its host's headers set, until
    the client is done (then half-closes upstream) or upgrades the connection."""
    r = _Buffered(client)
    while True:
        raw = await r.until(b"\r\n\r\n", MAX_HEAD)
        if raw is None:
            await upstream.write_eof()
            return
        head = Head(raw)
        headers = headers_for(head.host)
        await upstream.write(raw if headers is None else head.with_headers(headers, resolve))
        if head.get("upgrade") is not None or head.method == "CONNECT":
            if r.buf:
                await upstream.write(r.buf)
            await copy(client, upstream)
            return
        if "chunked" in (head.get("transfer-encoding") or "").lower():
            await _copy_chunked(r, upstream)
        elif (length := head.get("content-length")) is not None:
            await r.copy(int(length), upstream)


async def _copy_chunked(r: _Buffered, to: Stream) -> None:
    while True:
        line = await r.until(b"\r\n", 4096)
        if line is None:
            raise ConnectionError("the client closed in the middle of a chunked body")
        await to.write(line)
        size = int(line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while (trailer := await r.until(b"\r\n", MAX_HEAD)) not in (None, b"\r\n"):
                await to.write(trailer)
            await to.write(b"\r\n")
            return
        await r.copy(size + 2, to)


async def copy(src: Stream, dst: Stream) -> None:
    """Copies until EOF, then half-closes `dst`."""
    while data := await src.read(CHUNK):
        await dst.write(data)
    await dst.write_eof()


async def refuse(client: Stream, reason: str) -> None:
    """A 502 for the sandbox's client, saying why (never a secret's value)."""
    body = f"aenv egress proxy: {reason}\n".encode()
    head = (
        "HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with contextlib.suppress(OSError, ssl.SSLError):
        await client.write(head + body)
        await client.write_eof()


async def serve(
    client: Stream, upstream: Stream, headers_for: HeadersFor, resolve: Resolve, host: str
) -> None:
    """Both directions of an intercepted connection until both are done; a request that
    cannot be sent (a secret gone, a malformed head) gets a 502 and ends the connection."""
    responses = asyncio.create_task(copy(upstream, client))
    try:
        await relay_requests(client, upstream, headers_for, resolve)
    except UnknownSecret as e:
        log.info("egress to %s: secret %r is not defined for the sandbox's API key", host, e.name)
        responses.cancel()
        await refuse(client, f"secret {e.name!r} is not defined")
        return
    except ValueError as e:
        log.info("egress to %s: request refused: %s", host, e)
        responses.cancel()
        await refuse(client, f"request refused: {e}")
        return
    except BaseException:
        responses.cancel()
        raise
    finally:
        if responses.cancelled():
            with contextlib.suppress(asyncio.CancelledError):
                await responses
    await responses
