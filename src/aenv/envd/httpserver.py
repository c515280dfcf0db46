"""A small HTTP/1.1 server on asyncio streams.

Supports keep-alive, ``Content-Length`` and chunked request bodies (read
incrementally), fixed-length responses and streamed chunked responses that are
flushed per write, and detection of a client that went away while a response is
being streamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Awaitable, Callable

MAX_HEAD = 64 * 1024
READ_SIZE = 256 * 1024
# An unread request body up to this size is drained to keep the connection.
DRAIN_LIMIT = 4 * 1024 * 1024
# An upload answered early (507, 413) is read on for this much / this long before closing.
LINGER_LIMIT = 256 * 1024 * 1024
LINGER_SECONDS = 10.0

REASONS = {
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    406: "Not Acceptable",
    408: "Request Timeout",
    409: "Conflict",
    411: "Length Required",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    499: "Client Closed Request",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    507: "Insufficient Storage",
}


class HTTPError(Exception):
    """An error answered as ``{"code": status, "message": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ClientGone(Exception):
    """The peer closed the connection."""


_HEX = "0123456789abcdefABCDEF"


def unquote(s: str, plus: bool = False) -> str:
    """Percent-decode (UTF-8) without importing urllib.parse (start-up time)."""
    if plus:
        s = s.replace("+", " ")
    if "%" not in s:
        return s
    out = bytearray()
    parts = s.split("%")
    out += parts[0].encode()
    for part in parts[1:]:
        if len(part) >= 2 and part[0] in _HEX and part[1] in _HEX:
            out.append(int(part[:2], 16))
            out += part[2:].encode()
        else:
            out += b"%" + part.encode()
    return out.decode("utf-8", "replace")


def parse_query(qs: str) -> dict[str, str]:
    """First value of each query parameter."""
    out: dict[str, str] = {}
    for item in qs.split("&"):
        if not item:
            continue
        k, _, v = item.partition("=")
        out.setdefault(unquote(k, True), unquote(v, True))
    return out


def log(*parts: object, level: str = "info") -> None:
    # stderr may be gone; never fail because of logging
    with contextlib.suppress(Exception):
        print("envd:", *parts, file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        from . import journal

        journal.record(level, " ".join(str(p) for p in parts))


class Conn:
    """Buffered reader over one connection (with push-back for pipelining)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buf = bytearray()
        self.eof = False

    async def fill(self) -> bool:
        if self.eof:
            return False
        try:
            data = await self.reader.read(READ_SIZE)
        except (ConnectionError, OSError):
            data = b""
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    async def read_until(self, sep: bytes, limit: int) -> bytes | None:
        """Bytes up to and including ``sep``; None on EOF before it."""
        start = 0
        while True:
            i = self.buf.find(sep, start)
            if i >= 0:
                end = i + len(sep)
                out = bytes(self.buf[:end])
                del self.buf[:end]
                return out
            if len(self.buf) > limit:
                raise HTTPError(431, "request head too large")
            start = max(0, len(self.buf) - len(sep) + 1)
            if not await self.fill():
                return None

    async def read_some(self, n: int) -> bytes:
        if not self.buf and not await self.fill():
            return b""
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not await self.fill():
                raise ClientGone("connection closed mid-body")
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def wait_closed(self) -> None:
        """Return when the peer closes; buffered data is kept for later."""
        while len(self.buf) < MAX_HEAD:
            if not await self.fill():
                return
        await asyncio.Future()  # pipelined data piling up: never resolve


class Body:
    """A request body read incrementally (identity or chunked)."""

    def __init__(self, conn: Conn, length: int | None, chunked: bool) -> None:
        self.conn = conn
        self.chunked = chunked
        self.remaining = length or 0  # identity: bytes left; chunked: left in chunk
        self.done = not chunked and not length
        self.received = 0

    async def read(self, n: int = READ_SIZE) -> bytes:
        """Up to n bytes; b"" at the end of the body."""
        if self.done:
            return b""
        if self.chunked and self.remaining == 0:
            line = await self.conn.read_until(b"\r\n", 4096)
            if line is None:
                raise ClientGone("connection closed mid-body")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise HTTPError(400, "bad chunk size") from None
            if size == 0:
                while True:  # trailers up to the empty line
                    t = await self.conn.read_until(b"\r\n", MAX_HEAD)
                    if t is None or t == b"\r\n":
                        break
                self.done = True
                return b""
            self.remaining = size
        data = await self.conn.read_some(min(n, self.remaining))
        if not data:
            raise ClientGone("connection closed mid-body")
        self.remaining -= len(data)
        self.received += len(data)
        if self.remaining == 0:
            if self.chunked:
                if await self.conn.read_exact(2) != b"\r\n":
                    raise HTTPError(400, "bad chunk terminator")
            else:
                self.done = True
        return data

    async def read_all(self, limit: int) -> bytes:
        out = bytearray()
        while True:
            data = await self.read()
            if not data:
                return bytes(out)
            out += data
            if len(out) > limit:
                raise HTTPError(413, "request body too large")

    async def drain(self, limit: int) -> bool:
        """Discard the rest of the body; False if it is longer than limit."""
        seen = 0
        while not self.done:
            data = await self.read()
            seen += len(data)
            if seen > limit:
                return False
        return True


class Request:
    def __init__(
        self,
        conn: Conn,
        method: str,
        target: str,
        version: str,
        headers: dict[str, str],
    ) -> None:
        self.conn = conn
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers
        path, _, qs = target.partition("?")
        self.path = unquote(path)
        self.query = parse_query(qs)
        length: int | None = None
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if not chunked and "content-length" in headers:
            try:
                length = int(headers["content-length"])
            except ValueError:
                raise HTTPError(400, "bad content-length") from None
            if length < 0:
                raise HTTPError(400, "bad content-length")
        self.body = Body(conn, length, chunked)

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name, default)


class Response:
    def __init__(self, conn: Conn, keep_alive: bool) -> None:
        self.conn = conn
        self.keep_alive = keep_alive
        self.started = False
        self.finished = False
        self.streaming = False
        self.status = 0

    def _head(self, status: int, headers: list[tuple[str, str]]) -> bytearray:
        self.started = True
        self.status = status
        out = bytearray(f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\n".encode())
        for k, v in headers:
            out += f"{k}: {v}\r\n".encode("latin-1", "replace")
        if not self.keep_alive:
            out += b"Connection: close\r\n"
        return out

    async def _write(self, data: bytes | bytearray) -> None:
        w = self.conn.writer
        if w.is_closing():
            raise ClientGone("connection closed")
        try:
            w.write(data)
            await w.drain()
        except (ConnectionError, OSError) as e:
            raise ClientGone(str(e)) from e

    async def send(
        self,
        status: int,
        body: bytes = b"",
        headers: list[tuple[str, str]] | None = None,
        content_type: str | None = None,
    ) -> None:
        hs = list(headers or [])
        if content_type:
            hs.append(("Content-Type", content_type))
        out = self._head(status, hs)
        if status != 204 and status >= 200:
            out += f"Content-Length: {len(body)}\r\n".encode()
        out += b"\r\n"
        if status != 204:
            out += body
        self.finished = True
        await self._write(out)

    async def send_json(self, status: int, obj: object) -> None:
        await self.send(status, json.dumps(obj).encode(), content_type="application/json")

    async def send_error(self, status: int, message: str) -> None:
        await self.send_json(status, {"code": status, "message": message})

    async def start(
        self, status: int, headers: list[tuple[str, str]], length: int | None = None
    ) -> None:
        """Send the head of a streamed response (chunked unless length is given)."""
        out = self._head(status, headers)
        if length is None:
            self.streaming = True
            out += b"Transfer-Encoding: chunked\r\n\r\n"
        else:
            out += f"Content-Length: {length}\r\n\r\n".encode()
        await self._write(out)

    async def write(self, data: bytes) -> None:
        if not data:
            return
        if self.streaming:
            await self._write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            await self._write(data)

    async def end(self) -> None:
        self.finished = True
        if self.streaming:
            await self._write(b"0\r\n\r\n")


Handler = Callable[[Request, Response], Awaitable[None]]


async def _read_request(conn: Conn) -> Request | None:
    head = await conn.read_until(b"\r\n\r\n", MAX_HEAD)
    if head is None:
        return None
    # Tolerate leading empty lines between pipelined requests.
    lines = head.decode("latin-1").lstrip("\r\n").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise HTTPError(400, "bad request line")
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise HTTPError(400, "bad header line")
        key = name.strip().lower()
        value = value.strip()
        if key in headers:
            headers[key] = headers[key] + ", " + value
        else:
            headers[key] = value
    return Request(conn, method, target, version, headers)


async def _linger(req: Request) -> None:
    """Reads what is left of a request body answered early (a 507 mid-upload) before the
    connection closes: closing with unread data sends a reset, which can reach the client
    before the answer and lose it."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(req.body.drain(LINGER_LIMIT), LINGER_SECONDS)


def _wants_keep_alive(req: Request) -> bool:
    c = req.header("connection").lower()
    if req.version == "HTTP/1.0":
        return "keep-alive" in c
    return "close" not in c


async def serve_connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler
) -> None:
    conn = Conn(reader, writer)
    try:
        while True:
            try:
                req = await _read_request(conn)
            except HTTPError as e:
                resp = Response(conn, keep_alive=False)
                await resp.send_error(e.status, e.message)
                return
            if req is None:
                return
            resp = Response(conn, _wants_keep_alive(req))
            if req.header("expect").lower() == "100-continue":
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            try:
                await handler(req, resp)
            except ClientGone:
                return
            except HTTPError as e:
                if resp.started:
                    return
                resp.keep_alive = resp.keep_alive and e.status < 500
                await resp.send_error(e.status, e.message)
                if not resp.keep_alive:
                    await _linger(req)
            except Exception as e:  # a handler bug must not kill the server
                log("internal error:", req.method, req.path, repr(e), level="error")
                if resp.started:
                    return
                resp.keep_alive = False
                await resp.send_error(500, f"internal error: {e}")
            if not resp.finished or not resp.keep_alive:
                return
            try:
                if not await req.body.drain(DRAIN_LIMIT):
                    return
            except (HTTPError, ClientGone):
                return
    except (ClientGone, ConnectionError, OSError):
        pass
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log("connection error:", repr(e), level="warn")
    finally:
        with contextlib.suppress(Exception):
            writer.close()
