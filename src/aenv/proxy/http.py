"""HTTP/1.1 forwarding to a sandbox port, streaming in both directions.

A small forwarder on asyncio streams rather than httpx: it is on every envd round-trip. With
separate processes on uvloop (bench/proxy_overhead.py) it adds about 0.15 ms (p50) to a small
Connect unary POST, where the same router with a streaming httpx.AsyncClient forwarder added
about 1.2 ms (p50; p99 over 10 ms) and served a small fraction of the throughput. What it does:

- One keep-alive pool shared by all requests (pool.py). A request that finds a reused
  connection closed before any response byte goes again, once, on a fresh connection, if
  what was written so far is small enough to have been kept (64 KiB).
- The request body is forwarded as it arrives: `Content-Length` bodies as they are, anything
  else as `Transfer-Encoding: chunked`, one chunk per ASGI message; a chunked request is sent
  upstream before its body starts, in case the client waits for the response first. The
  response body is passed on as it is read (each upstream read becomes one ASGI message), so
  Connect envelopes and NDJSON lines reach the client as soon as the sandbox writes them.
- A connect timeout, no read timeout: streams may sit idle for minutes.
- A client that goes away aborts the upstream connection, so the sandbox sees the request end.
  An upstream that breaks off mid-body makes the client connection close (a truncated body is
  never presented as a complete one); one that resets it, or a sandbox that stopped, resets
  the client's. The reset is what the SDKs read as the connection lost (they then probe the
  sandbox and report it killed), and a gateway in front of a node passes the node's on.
- Hop-by-hop headers (and those named by `Connection`) are dropped both ways; `Expect` is
  answered by the ASGI server, so it is not forwarded; 1xx interim responses are not relayed.
  Everything else passes unchanged, `Host` included (see dispatch.py), the names written in
  their canonical case (`Content-Type`) as E2B's proxy writes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from aenv.errors import SandboxNotFound

from ._common import (
    Exposer,
    Headers,
    Message,
    Receive,
    Scope,
    Send,
    Target,
    canonical_name,
    connect_exposing,
    end_to_end,
    reset_client,
    send_json,
)
from .http1 import UpstreamProtocolError, describe, parse_head
from .pool import Connection, ConnectionPool

log = logging.getLogger(__name__)

_REQUEST_DROP = frozenset({b"content-length", b"expect"})
_NO_DROP: frozenset[bytes] = frozenset()
_READ_SIZE = 1 << 16
_REPLAY_LIMIT = 1 << 16  # request bytes kept for a retry on a fresh connection
# How long a reset client connection may take to reach the server (`_until_client_gone`).
CLIENT_GONE_WAIT = 1.0


class _Retry(Exception):
    """A reused connection was dead before it answered; the request may go again."""


class HttpForwarder:
    """Forwards one ASGI HTTP request to a resolved `Target`."""

    def __init__(
        self,
        *,
        connect_timeout: float = 5.0,
        idle_timeout: float = 4.0,
        pool: ConnectionPool | None = None,
        expose: Exposer | None = None,
    ) -> None:
        self.pool = pool or ConnectionPool(
            connect_timeout=connect_timeout, idle_timeout=idle_timeout
        )
        self.expose = expose

    async def forward(self, scope: Scope, receive: Receive, send: Send, target: Target) -> None:
        await _Exchange(self.pool, scope, receive, send, target, self.expose).run()

    def drop(self, sandbox_id: str) -> None:
        self.pool.drop(sandbox_id)

    async def aclose(self) -> None:
        await self.pool.aclose()


class _Exchange:
    """One request/response through the proxy."""

    def __init__(
        self,
        pool: ConnectionPool,
        scope: Scope,
        receive: Receive,
        send: Send,
        target: Target,
        expose: Exposer | None = None,
    ) -> None:
        self.pool = pool
        self.expose = expose
        self.scope = scope
        self.receive = receive
        self.send = send
        self.target = target
        self.conn: Connection | None = None
        self.owned = True  # False once the connection went back to the pool
        self.client_gone = False
        self.chunked_body = False
        self.body_done = False  # the whole request body was written upstream
        # What was written upstream, while it is small enough to write again on a retry.
        self.replay: list[bytes] | None = []
        self.replay_size = 0
        self.client_task: asyncio.Task[None] | None = None
        # The first body message when it had not arrived with the head (chunked requests).
        self.pending_first: asyncio.Future[Message] | None = None

    # -- client side -------------------------------------------------------------------

    def _client_gone(self) -> None:
        self.client_gone = True
        if self.owned and self.conn is not None:
            self.conn.abort()

    async def _client_side(self) -> None:
        """Pump the rest of the request body upstream, then watch for a client disconnect."""
        try:
            while not self.body_done:
                pending, self.pending_first = self.pending_first, None
                if pending is not None and not pending.cancelled():
                    message = await pending
                else:
                    message = await self.receive()
                if message["type"] != "http.request":
                    self._client_gone()
                    return
                data: bytes = message.get("body", b"")
                more = bool(message.get("more_body", False))
                assert self.conn is not None
                writer = self.conn.writer
                if self.chunked_body:
                    out = b"%x\r\n%b\r\n" % (len(data), data) if data else b""
                    if not more:
                        out += b"0\r\n\r\n"
                else:
                    out = data
                if out:
                    self._write(out)
                if not more:
                    self.body_done = True
                await writer.drain()
            await self.receive()  # nothing but http.disconnect can come now
            self._client_gone()
        except OSError:
            return  # the upstream stopped reading; the response side reports it

    def _write(self, data: bytes) -> None:
        assert self.conn is not None
        self.conn.writer.write(data)
        if self.replay is not None:
            self.replay_size += len(data)
            if self.replay_size > _REPLAY_LIMIT:
                self.replay = None
            else:
                self.replay.append(data)

    def _start_client_side(self) -> None:
        self.client_task = asyncio.get_running_loop().create_task(self._client_side())

    async def _until_client_gone(self) -> None:
        """After a reset of the client's connection: until the server has seen it end (its
        receive says so), which over TLS takes a few loop turns. Returning before that, the
        response reads to the server as one the app left unfinished, an error in its log."""
        task = self.client_task
        if task is not None and not task.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(task), CLIENT_GONE_WAIT)

    def _cancel_client_side(self) -> None:
        # Cancelling is enough: the task runs no more of its code, and an ASGI receive()
        # interrupted while waiting loses nothing.
        task, self.client_task = self.client_task, None
        if task is not None:
            task.cancel()

    async def _send(self, message: Message) -> None:
        try:
            await self.send(message)
        except OSError:  # some ASGI servers raise ClientDisconnected (an OSError)
            self._client_gone()

    # -- the exchange ------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self._cancel_client_side()
            if self.pending_first is not None:
                self.pending_first.cancel()
            if self.owned and self.conn is not None:
                self.conn.abort()

    async def _run(self) -> None:
        content_length: bytes | None = None
        has_te = False
        for name, value in self.target.headers:
            if name == b"content-length":
                content_length = value
            elif name == b"transfer-encoding":
                has_te = True

        first: Message | None
        if has_te:
            # A chunked body may be an interactive stream whose first bytes come only after
            # the response has started, so do not wait for it before opening the request.
            pending: asyncio.Future[Message] = asyncio.ensure_future(self.receive())
            await asyncio.sleep(0)
            if pending.done():
                first = pending.result()
            else:
                first, self.pending_first = None, pending
        else:
            first = await self.receive()
        if first is None:
            body, more = b"", True
        elif first["type"] != "http.request":
            return
        else:
            body, more = first.get("body", b""), bool(first.get("more_body", False))

        if content_length is not None and not has_te:
            framing = b"content-length: " + content_length + b"\r\n"
            initial_body = body
        elif has_te or more:
            framing = b"transfer-encoding: chunked\r\n"
            self.chunked_body = True
            initial_body = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more:
                initial_body += b"0\r\n\r\n"
        elif body:
            framing = b"content-length: %d\r\n" % len(body)
            initial_body = body
        else:
            framing = b""
            initial_body = b""
        self.body_done = not more
        head = self._request_head(framing)

        target = self.target
        key = (target.sandbox_id, target.host, target.port)
        fresh = False
        while True:
            try:
                conn = await connect_exposing(
                    functools.partial(
                        self.pool.acquire, key, target.host, target.port, fresh=fresh
                    ),
                    target,
                    self.expose,
                )
            except (OSError, TimeoutError) as exc:
                self._cancel_client_side()
                await self._fail_before_response(describe(exc))
                return
            self.conn = conn
            if fresh:
                assert self.replay is not None
                conn.writer.write(b"".join(self.replay))
            elif len(initial_body) < _READ_SIZE:
                self._write(head + initial_body)
            else:
                self._write(head)
                self._write(initial_body)
            self._start_client_side()
            try:
                version, status, raw_headers = await self._read_head(conn)
                self.replay = None
                break
            except _Retry:
                self._cancel_client_side()
                conn.abort()
                if self.replay is None or fresh:
                    await self._fail_before_response("connection closed before a response")
                    return
                fresh = True
            except (
                OSError,
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
                UpstreamProtocolError,
            ) as exc:
                self._cancel_client_side()
                conn.abort()
                await self._fail_before_response(describe(exc))
                return

        await self._relay_response(conn, version, status, raw_headers)

    def _request_head(self, framing: bytes) -> bytes:
        target = self.target
        parts = [
            self.scope["method"].encode("ascii"),
            b" ",
            target.request_target,
            b" HTTP/1.1\r\n",
        ]
        has_host = False
        for name, value in end_to_end(target.headers, _REQUEST_DROP):
            if name == b"host":
                has_host = True
            parts += (canonical_name(name), b": ", value, b"\r\n")
        if not has_host:
            parts += (b"Host: ", target.authority.encode(), b"\r\n")
        parts += (framing, b"\r\n")
        return b"".join(parts)

    async def _read_head(self, conn: Connection) -> tuple[bytes, int, Headers]:
        reader = conn.reader
        first = True
        while True:
            try:
                data = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if first and conn.reused and not exc.partial and self._may_retry(conn):
                    raise _Retry from exc
                raise
            except (ConnectionResetError, BrokenPipeError) as exc:
                if first and conn.reused and self._may_retry(conn):
                    raise _Retry from exc
                raise
            first = False
            version, status, headers = parse_head(data)
            if 100 <= status < 200:
                if status == 101:
                    raise UpstreamProtocolError("unexpected 101 Switching Protocols")
                continue  # interim responses (100 Continue, 103 Early Hints) are not relayed
            return version, status, headers

    def _may_retry(self, conn: Connection) -> bool:
        return not (self.client_gone or conn.dropped)

    async def _fail_before_response(self, reason: str) -> None:
        if self.client_gone:
            return
        if self.conn is not None and self.conn.dropped:
            await send_json(self.send, 502, SandboxNotFound(self.target.sandbox_id).to_json())
            return
        log.info(
            "proxy: sandbox %s port %s unreachable: %s",
            self.target.sandbox_id,
            self.target.sandbox_port,
            reason,
        )
        await send_json(self.send, 502, self.target.unreachable(reason))

    async def _relay_response(
        self, conn: Connection, version: bytes, status: int, raw_headers: Headers
    ) -> None:
        chunked = False
        length: int | None = None
        keep_alive = version == b"HTTP/1.1"
        for name, value in raw_headers:
            if name == b"transfer-encoding":
                chunked = value.rsplit(b",", 1)[-1].strip().lower() == b"chunked"
                if not chunked:
                    keep_alive = False  # body runs until close
            elif name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = -1
            elif name == b"connection":
                tokens = {t.strip().lower() for t in value.split(b",")}
                if b"close" in tokens:
                    keep_alive = False
                elif b"keep-alive" in tokens and version == b"HTTP/1.0":
                    keep_alive = True
        if length is not None and length < 0 and not chunked:
            self._cancel_client_side()
            conn.abort()
            await self._fail_before_response("invalid content-length in the response")
            return
        headers = end_to_end(raw_headers, _NO_DROP)
        no_body = self.scope["method"] == "HEAD" or status in (204, 304)
        if chunked or (status in (204, 304) and self.scope["method"] != "HEAD"):
            # ASGI servers hold a Content-Length against the body they are given; a 304's
            # (the size of what was not sent) would make them fail the response.
            headers = [(n, v) for n, v in headers if n != b"content-length"]
        elif length is None and not no_body:
            keep_alive = False  # body delimited by close

        await self._send({"type": "http.response.start", "status": status, "headers": headers})

        reader = conn.reader
        try:
            if no_body or (length == 0 and not chunked):
                await self._finish(conn, keep_alive, b"")
            elif chunked:
                await self._relay_chunked(conn, reader, keep_alive)
            elif length is not None:
                remaining = length
                while remaining > 0:
                    data = await reader.read(min(remaining, _READ_SIZE))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", remaining)
                    remaining -= len(data)
                    if remaining:
                        await self._send(
                            {"type": "http.response.body", "body": data, "more_body": True}
                        )
                    else:
                        await self._finish(conn, keep_alive, data)
            else:
                while data := await reader.read(_READ_SIZE):
                    await self._send(
                        {"type": "http.response.body", "body": data, "more_body": True}
                    )
                if self.client_gone:
                    return
                await self._finish(conn, False, b"")
        except (
            OSError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ValueError,
            UpstreamProtocolError,
        ) as exc:
            if not self.client_gone:
                # Returning without finishing makes the ASGI server cut the client connection,
                # which is how a truncated body is signalled; a sandbox that is gone resets it,
                # and so does an upstream that reset ours (a node behind a gateway that reset
                # the stream of a sandbox it stopped: the client must learn it the same way).
                reset = conn.dropped or isinstance(exc, ConnectionResetError)
                if reset and reset_client(self.send):
                    await self._until_client_gone()
                log.log(
                    logging.INFO if reset else logging.WARNING,
                    "proxy: sandbox %s port %s: upstream response broken off: %s",
                    self.target.sandbox_id,
                    self.target.sandbox_port,
                    describe(exc),
                )

    async def _relay_chunked(
        self, conn: Connection, reader: asyncio.StreamReader, keep_alive: bool
    ) -> None:
        while True:
            line = await reader.readuntil(b"\r\n")
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailers are dropped (HTTP/1.1 clients rarely ask for them)
                await self._finish(conn, keep_alive, b"")
                return
            remaining = size
            while remaining > 0:
                data = await reader.read(min(remaining, _READ_SIZE))
                if not data:
                    raise asyncio.IncompleteReadError(b"", remaining)
                remaining -= len(data)
                await self._send({"type": "http.response.body", "body": data, "more_body": True})
            if await reader.readexactly(2) != b"\r\n":
                raise UpstreamProtocolError("bad chunk terminator")

    async def _finish(self, conn: Connection, keep_alive: bool, last: bytes) -> None:
        """The upstream response is complete: settle the connection, then end the client's."""
        if self.client_gone:
            return
        # Stop watching the client first: completing the response wakes the ASGI receive().
        self._cancel_client_side()
        self.owned = False
        if keep_alive and self.body_done and not self.client_gone:
            self.pool.release(conn)
        else:
            conn.close()
        await self._send({"type": "http.response.body", "body": last, "more_body": False})
