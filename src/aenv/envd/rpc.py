"""Connect-RPC (JSON codec only): unary, server-streaming and client-streaming.

Handlers work on plain proto3-JSON dicts. Errors are raised as ``RPCError``
and rendered per the Connect protocol: a JSON body with the mapped HTTP status
for unary calls, an end-of-stream envelope (flag 0x02) for streams.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .httpserver import ClientGone, HTTPError, Request, Response

if TYPE_CHECKING:
    from .state import User

STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}

MAX_MESSAGE = 64 * 1024 * 1024
KEEPALIVE_DEFAULT = 30.0
FLAG_COMPRESSED = 0x01
FLAG_END = 0x02

Msg = dict[str, Any]


class RPCError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def to_json(self) -> Msg:
        return {"code": self.code, "message": self.message}


# ---- proto3 JSON helpers ----------------------------------------------------


def b64e(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64d(value: object) -> bytes:
    if not value:
        return b""
    if not isinstance(value, str):
        raise RPCError("invalid_argument", "bytes field must be a base64 string")
    s = value.strip().replace("-", "+").replace("_", "/")
    s += "=" * (-len(s) % 4)
    try:
        return base64.b64decode(s, validate=False)
    except ValueError:
        raise RPCError("invalid_argument", "invalid base64") from None


def field(msg: Msg, camel: str, snake: str | None = None, default: Any = None) -> Any:
    """A field by its JSON name or its original proto name."""
    if camel in msg:
        return msg[camel]
    if snake is not None and snake in msg:
        return msg[snake]
    return default


def as_int(value: object, name: str, default: int = 0) -> int:
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        raise RPCError("invalid_argument", f"{name} must be an integer")
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise RPCError("invalid_argument", f"{name} must be an integer") from None


def as_str(value: object, name: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RPCError("invalid_argument", f"{name} must be a string")
    return value


def as_bool(value: object) -> bool:
    return bool(value) and value not in ("false", "0")


def as_msg(value: object, name: str) -> Msg:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RPCError("invalid_argument", f"{name} must be an object")
    return value


def timestamp(seconds: float, nanos: int | None = None) -> str:
    """RFC 3339 UTC timestamp, nanosecond precision when given."""
    whole = int(seconds)
    frac = nanos if nanos is not None else int(round((seconds - whole) * 1e9))
    if frac >= 1_000_000_000:
        whole, frac = whole + 1, frac - 1_000_000_000
    t = time.gmtime(whole)
    base = time.strftime("%Y-%m-%dT%H:%M:%S", t)
    if not frac:
        return base + "Z"
    digits = f"{frac:09d}"  # proto3 JSON: 3, 6 or 9 fractional digits
    for n in (3, 6):
        if digits[n:] == "0" * (9 - n):
            return f"{base}.{digits[:n]}Z"
    return f"{base}.{digits}Z"


# ---- envelopes --------------------------------------------------------------


def envelope(obj: Msg, flags: int = 0) -> bytes:
    payload = json.dumps(obj, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


def _decode_payload(flags: int, payload: bytes, req: Request) -> Msg:
    if flags & FLAG_COMPRESSED:
        enc = req.header("connect-content-encoding", "identity").lower()
        if enc != "gzip":
            raise RPCError("internal", f"compressed message with encoding {enc!r}")
        import zlib

        payload = zlib.decompress(payload, 31)
    return _parse_json(payload)


def _parse_json(payload: bytes) -> Msg:
    if not payload.strip():
        return {}
    try:
        obj = json.loads(payload)
    except ValueError as e:
        raise RPCError("invalid_argument", f"invalid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise RPCError("invalid_argument", "message must be a JSON object")
    return obj


async def read_envelopes(req: Request) -> AsyncIterator[Msg]:
    """Messages of a streamed request body, until its end (or end envelope)."""
    buf = bytearray()
    eof = False
    while True:
        while len(buf) < 5 and not eof:
            data = await req.body.read()
            if data:
                buf += data
            else:
                eof = True
        if len(buf) < 5:
            if buf:
                raise RPCError("invalid_argument", "truncated envelope")
            return
        flags, size = struct.unpack(">BI", bytes(buf[:5]))
        if size > MAX_MESSAGE:
            raise RPCError("resource_exhausted", "message too large")
        while len(buf) < 5 + size:
            data = await req.body.read()
            if not data:
                raise RPCError("invalid_argument", "truncated envelope")
            buf += data
        payload = bytes(buf[5 : 5 + size])
        del buf[: 5 + size]
        if flags & FLAG_END:
            return
        yield _decode_payload(flags, payload, req)


# ---- call context and dispatch ----------------------------------------------


class Ctx:
    """Per-call context handed to handlers."""

    def __init__(self, req: Request, user: User, timeout: float | None) -> None:
        self.req = req
        self.user = user
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout if timeout is not None else None
        self.on_deadline: list[Callable[[], None]] = []
        ka = KEEPALIVE_DEFAULT
        hv = req.header("keepalive-ping-interval")
        if hv:
            try:
                v = float(hv)
                if 0 < v < ka:
                    ka = v
            except ValueError:
                pass
        self.keepalive = ka

    def remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())


Send = Callable[[Msg], Awaitable[None]]
Unary = Callable[[Ctx, Msg], "Awaitable[Msg] | Msg"]
ServerStream = Callable[[Ctx, Msg, Send], Awaitable[None]]
ClientStream = Callable[[Ctx, AsyncIterator[Msg]], Awaitable[Msg]]


class Method:
    __slots__ = ("kind", "func", "keepalive_msg")

    def __init__(self, kind: str, func: Any, keepalive_msg: Msg | None = None) -> None:
        self.kind = kind  # "unary" | "server" | "client"
        self.func = func
        self.keepalive_msg = keepalive_msg


def parse_timeout(req: Request) -> float | None:
    v = req.header("connect-timeout-ms")
    if not v:
        return None
    try:
        ms = int(v)
    except ValueError:
        raise RPCError("invalid_argument", "bad Connect-Timeout-Ms") from None
    return ms / 1000.0 if ms > 0 else None  # 0 means no deadline (as envd)


async def send_unary_error(resp: Response, err: RPCError) -> None:
    await resp.send(
        STATUS.get(err.code, 500),
        json.dumps(err.to_json()).encode(),
        content_type="application/json",
    )


async def send_stream_error(resp: Response, err: RPCError) -> None:
    await resp.start(200, [("Content-Type", "application/connect+json")])
    await resp.write(envelope({"error": err.to_json()}, FLAG_END))
    await resp.end()


def _internal(e: BaseException) -> RPCError:
    if isinstance(e, RPCError):
        return e
    if isinstance(e, HTTPError):
        code = {400: "invalid_argument", 413: "resource_exhausted"}.get(e.status, "internal")
        return RPCError(code, e.message)
    return RPCError("internal", f"{type(e).__name__}: {e}")


async def run_unary(ctx: Ctx, resp: Response, method: Method) -> None:
    req = ctx.req
    ctype = req.header("content-type").split(";")[0].strip().lower()
    if ctype not in ("application/json", ""):
        await resp.send(
            415,
            b"",
            headers=[("Accept-Post", "application/json")],
        )
        return
    try:
        enc = req.header("content-encoding", "identity").lower()
        raw = await req.body.read_all(MAX_MESSAGE)
        if enc == "gzip":
            import zlib

            raw = zlib.decompress(raw, 31)
        elif enc not in ("identity", ""):
            raise RPCError("unimplemented", f"unsupported content-encoding {enc!r}")
        msg = _parse_json(raw)
        res = method.func(ctx, msg)  # plain functions are quick, blocking calls
        if not asyncio.iscoroutine(res):
            out = res
        elif ctx.timeout is not None:
            try:
                out = await asyncio.wait_for(res, ctx.timeout)
            except TimeoutError:
                raise RPCError("deadline_exceeded", "deadline exceeded") from None
        else:
            out = await res
    except ClientGone:
        raise
    except Exception as e:
        await send_unary_error(resp, _internal(e))
        return
    await resp.send(200, json.dumps(out).encode(), content_type="application/json")


async def run_server_stream(ctx: Ctx, resp: Response, method: Method) -> None:
    req = ctx.req
    try:
        msg: Msg | None = None
        async for m in read_envelopes(req):
            if msg is None:
                msg = m
        if msg is None:
            msg = {}
    except ClientGone:
        raise
    except Exception as e:
        await send_stream_error(resp, _internal(e))
        return

    await resp.start(200, [("Content-Type", "application/connect+json")])
    lock = asyncio.Lock()
    gone = False

    async def send(m: Msg) -> None:
        nonlocal gone
        async with lock:
            try:
                await resp.write(envelope(m))
            except ClientGone:
                gone = True
                raise

    async def keepalive() -> None:
        assert method.keepalive_msg is not None
        while True:
            await asyncio.sleep(ctx.keepalive)
            await send(method.keepalive_msg)

    main = asyncio.ensure_future(method.func(ctx, msg, send))
    ka = asyncio.ensure_future(keepalive()) if method.keepalive_msg else None
    closed = asyncio.ensure_future(req.conn.wait_closed())
    waiters: set[asyncio.Future[Any]] = {main, closed}
    if ka is not None:
        waiters.add(ka)
    error: RPCError | None = None
    try:
        done, _ = await asyncio.wait(
            waiters, timeout=ctx.remaining(), return_when="FIRST_COMPLETED"
        )
        if main in done:
            exc = main.exception()
            if exc is not None:
                if isinstance(exc, ClientGone) or gone:
                    raise ClientGone("client gone")
                error = _internal(exc)
        elif closed in done or (ka is not None and ka in done):
            raise ClientGone("client gone")
        else:  # deadline
            for cb in ctx.on_deadline:
                with contextlib.suppress(Exception):
                    cb()
            error = RPCError("deadline_exceeded", "deadline exceeded")
    finally:
        for t in (main, ka, closed):
            if t is not None and not t.done():
                t.cancel()
        await asyncio.gather(*(t for t in (main, ka) if t is not None), return_exceptions=True)
    async with lock:
        end: Msg = {"error": error.to_json()} if error else {}
        await resp.write(envelope(end, FLAG_END))
        await resp.end()


async def run_client_stream(ctx: Ctx, resp: Response, method: Method) -> None:
    try:
        coro = method.func(ctx, read_envelopes(ctx.req))
        if ctx.timeout is not None:
            try:
                out = await asyncio.wait_for(coro, ctx.timeout)
            except TimeoutError:
                raise RPCError("deadline_exceeded", "deadline exceeded") from None
        else:
            out = await coro
    except ClientGone:
        raise
    except Exception as e:
        await send_stream_error(resp, _internal(e))
        return
    await resp.start(200, [("Content-Type", "application/connect+json")])
    await resp.write(envelope(out) + envelope({}, FLAG_END))
    await resp.end()


async def dispatch(
    req: Request,
    resp: Response,
    method: Method | None,
    authenticate: Callable[[Request], User],
) -> None:
    streaming = req.header("content-type").lower().startswith("application/connect+")
    if method is None:
        err = RPCError("unimplemented", f"unknown method {req.path}")
        if streaming:
            await send_stream_error(resp, err)
        else:
            await send_unary_error(resp, err)
        return
    try:
        if req.method != "POST":
            raise RPCError("unimplemented", "only POST is supported")
        user = authenticate(req)
        ctx = Ctx(req, user, parse_timeout(req))
    except RPCError as err:
        if method.kind == "unary":
            await send_unary_error(resp, err)
        else:
            await send_stream_error(resp, err)
        return
    if method.kind == "unary":
        await run_unary(ctx, resp, method)
    elif method.kind == "server":
        await run_server_stream(ctx, resp, method)
    else:
        await run_client_stream(ctx, resp, method)
