"""``GET /files`` (download) and ``POST /files`` (multipart or raw upload).

Bodies are streamed: downloads are read from disk in chunks (gzip-compressed
on the fly when the client accepts it); uploads are written to disk as they
arrive, including multipart parts and gzip-encoded raw bodies.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat as st
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from .filesystem import make_dirs
from .httpserver import HTTPError, Request, Response
from .state import User, resolve_path

if TYPE_CHECKING:
    from .filesystem import Metadata
    from .state import State

CHUNK = 256 * 1024
MAX_PART_HEAD = 16 * 1024
METADATA_HEADER = "x-metadata-"


# What the path itself provokes (too long, a symlink loop, a file used as a directory).
_PATH_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR})


def file_signature(path: str, op: str, user: str, token: str, exp: str | None) -> str:
    """E2B's v1 signature of a file URL (`op` is read or write); the node routes signed URLs
    that name no sandbox by it too."""
    import base64
    import hashlib

    raw = f"{path}:{op}:{user}:{token}" + (f":{exp}" if exp is not None else "")
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


def check_file_auth(req: Request, state: State, op: str) -> None:
    """Access token header or a valid signed URL (``signature``/``signature_expiration``)."""
    token = state.access_token
    if not token:
        return
    import hmac

    header = req.header("x-access-token")
    if header:
        if hmac.compare_digest(header.encode(), token.encode()):
            return
        raise HTTPError(401, "access token present in header but does not match")
    sig = req.query.get("signature")
    if not sig:
        raise HTTPError(401, "missing access token or signature")
    exp = req.query.get("signature_expiration")
    expected = file_signature(
        req.query.get("path", ""), op, req.query.get("username", ""), token, exp
    )
    if not hmac.compare_digest(expected.encode(), sig.encode()):
        raise HTTPError(401, "invalid signature")
    if exp is not None:
        try:
            expired = int(exp) < time.time()
        except ValueError:
            raise HTTPError(401, "invalid signature expiration") from None
        if expired:
            raise HTTPError(401, "signature is already expired")


def _accepts_gzip(value: str) -> bool:
    for item in value.split(","):
        name, _, params = item.strip().partition(";")
        if name.strip().lower() in ("gzip", "x-gzip"):
            q = params.strip()
            return not (q.startswith("q=") and q[2:].strip() in ("0", "0.0", "0.00", "0.000"))
    return False


async def download(req: Request, resp: Response, user: User) -> None:
    raw = req.query.get("path")
    if not raw:
        raise HTTPError(400, "path query parameter is required")
    path = _resolve(raw, user)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise HTTPError(404, f"path '{path}' does not exist") from None
    except IsADirectoryError:
        raise HTTPError(400, f"path '{path}' is a directory") from None
    except PermissionError:
        raise HTTPError(403, f"permission denied: '{path}'") from None
    except OSError as e:
        if e.errno in _PATH_ERRNOS:
            raise HTTPError(400, f"path '{path}': {e.strerror}") from None
        raise HTTPError(500, f"error opening '{path}': {e}") from None
    try:
        info = os.fstat(fd)
        if st.S_ISDIR(info.st_mode):
            raise HTTPError(400, f"path '{path}' is a directory")
        name = os.path.basename(path)
        headers = [
            ("Content-Type", "application/octet-stream"),
            ("Content-Disposition", f"attachment; filename*=UTF-8''{quote(name, safe='')}"),
            ("Vary", "Accept-Encoding"),
        ]
        # The first read before the answer starts: a file that cannot be read at all (EIO
        # from /proc/self/mem, EINVAL from some device files) is a clean 400, not a stream
        # cut after a 200. A read error later still cuts the connection: never padded.
        try:
            first = os.read(fd, CHUNK)
        except OSError as e:
            raise HTTPError(400, f"path '{path}' cannot be read: {e.strerror}") from None
        if _accepts_gzip(req.header("accept-encoding")):
            import zlib

            comp = zlib.compressobj(6, zlib.DEFLATED, 31)
            headers.append(("Content-Encoding", "gzip"))
            await resp.start(200, headers)
            data = first
            while data:
                await resp.write(comp.compress(data))
                data = os.read(fd, CHUNK)
            await resp.write(comp.flush())
            await resp.end()
            return
        # A size of 0 may be a lie (/proc, /sys files): stream those chunked to EOF.
        size = info.st_size if st.S_ISREG(info.st_mode) and info.st_size > 0 else None
        await resp.start(200, headers, length=size)
        sent = 0
        data = first[:size] if size is not None else first
        while data:
            sent += len(data)
            await resp.write(data)
            if size is not None and sent >= size:
                break
            data = os.read(fd, min(CHUNK, size - sent) if size is not None else CHUNK)
        if size is not None and sent < size:  # file shrank while sending: pad
            # the connection cannot be kept in a consistent state otherwise
            resp.keep_alive = False
            await resp.write(b"\0" * (size - sent))
        await resp.end()
    finally:
        os.close(fd)


# ---- uploads ----------------------------------------------------------------


class _Source:
    """Reads the (possibly gzip-encoded) request body."""

    def __init__(self, req: Request) -> None:
        self.req = req
        self.dec: Any = None
        enc = req.header("content-encoding").strip().lower()
        if enc in ("gzip", "x-gzip"):
            import zlib

            self.dec = zlib.decompressobj(47)
        elif enc not in ("", "identity"):
            raise HTTPError(400, f"unsupported content-encoding {enc!r}")
        self.pending = b""

    async def read(self) -> bytes:
        if self.dec is None:
            return await self.req.body.read(CHUNK)
        while True:
            if self.dec.unconsumed_tail:
                out = self.dec.decompress(self.dec.unconsumed_tail, CHUNK)
            else:
                data = await self.req.body.read(CHUNK)
                if not data:
                    if self.dec.eof:
                        return b""
                    out = self.dec.flush()
                    self.dec = _Done()
                    if not out:
                        return b""
                    return out
                try:
                    out = self.dec.decompress(data, CHUNK)
                except Exception as e:
                    raise HTTPError(400, f"invalid gzip body: {e}") from None
            if out:
                return out


class _Done:
    unconsumed_tail = b""
    eof = True

    def decompress(self, data: bytes, n: int) -> bytes:  # noqa: ARG002
        return b""

    def flush(self) -> bytes:
        return b""


class _Writer:
    """Writes one uploaded file: parents created, owned by the user."""

    def __init__(self, path: str, user: User) -> None:
        self.path = path
        try:
            make_dirs(os.path.dirname(path) or "/", user)
        except NotADirectoryError:
            raise HTTPError(400, f"a parent of '{path}' is not a directory") from None
        except OSError as e:
            raise _io_error(e, path) from None
        if os.path.isdir(path):
            raise HTTPError(400, f"path '{path}' is a directory")
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise _io_error(e, path) from None
        with contextlib.suppress(OSError):
            os.fchown(self.fd, user.uid, user.gid)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except OSError as e:
                self.close()
                raise _io_error(e, self.path) from None
            view = view[n:]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _resolve(raw: str, user: User) -> str:
    try:
        return resolve_path(raw, user)
    except ValueError as e:
        raise HTTPError(400, str(e)) from None


def _io_error(e: OSError, path: str) -> HTTPError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return HTTPError(507, f"not enough disk space available to write '{path}'")
    if e.errno in _PATH_ERRNOS:
        return HTTPError(400, f"path '{path}': {e.strerror}")
    if isinstance(e, PermissionError):
        return HTTPError(403, f"permission denied: '{path}'")
    if isinstance(e, IsADirectoryError):
        return HTTPError(400, f"path '{path}' is a directory")
    return HTTPError(500, f"error writing '{path}': {e.strerror or e}")


_PARAM = re.compile(r';\s*([A-Za-z0-9_*.-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')


def _header_params(value: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for m in _PARAM.finditer(value):
        k, v = m.group(1).lower(), m.group(2).strip()
        if v.startswith('"') and v.endswith('"') and len(v) >= 2:
            v = re.sub(r"\\(.)", r"\1", v[1:-1])
        out[k] = v
    return out


def _form_unescape(value: str) -> str:
    """Undo HTML5 form-data escaping of quotes and control characters."""

    def rep(m: re.Match[str]) -> str:
        code = int(m.group(1), 16)
        return chr(code) if code < 0x20 or code == 0x22 else m.group(0)

    return re.sub(r"%([0-9A-Fa-f]{2})", rep, value)


def _part_filename(headers: dict[str, str]) -> tuple[str, str | None]:
    disp = headers.get("content-disposition", "")
    params = _header_params(";" + disp.partition(";")[2])
    name = params.get("name", "")
    if "filename*" in params:
        v = params["filename*"]
        _, _, encoded = v.partition("''")
        from urllib.parse import unquote

        return name, unquote(encoded or v)
    fn = params.get("filename")
    return name, _form_unescape(fn) if fn is not None else None


def _scan(buf: bytearray, sep: bytes) -> tuple[str, int, int]:
    """Find the next delimiter line in buf.

    Returns ("delim" | "final", data_end, resume) when found (resume = index
    after the delimiter line), or ("more", safe_end, 0) when more input is
    needed (bytes before safe_end are certainly part data).
    """
    start = 0
    n = len(buf)
    while True:
        k = buf.find(sep, start)
        if k < 0:
            return "more", max(0, n - len(sep) + 1), 0
        i = k + len(sep)
        if n - i < 2:
            return "more", k, 0
        if buf[i : i + 2] == b"--":
            return "final", k, i + 2
        while i < n and buf[i] in (0x20, 0x09):  # transport padding
            i += 1
        if n - i < 2:
            return "more", k, 0
        if buf[i : i + 2] == b"\r\n":
            return "delim", k, i + 2
        start = k + 1  # boundary text inside the data, not a delimiter


async def _multipart(src: _Source, boundary: str, on_part: Any, on_data: Any, on_end: Any) -> None:
    sep = b"\r\n--" + boundary.encode("latin-1")
    buf = bytearray(b"\r\n")  # so a delimiter at the very start matches too
    eof = False
    in_part = False

    async def more() -> None:
        nonlocal eof
        data = b"" if eof else await src.read()
        if not data:
            eof = True
            raise HTTPError(400, "truncated multipart body")
        buf.extend(data)

    while True:
        kind, end, resume = _scan(buf, sep)
        if kind == "more":
            if end:
                if in_part:
                    on_data(bytes(buf[:end]))
                del buf[:end]
            await more()
            continue
        if in_part:
            if end:
                on_data(bytes(buf[:end]))
            on_end()
            in_part = False
        del buf[:resume]
        if kind == "final":
            return
        while not buf.startswith(b"\r\n") and buf.find(b"\r\n\r\n") < 0:
            if len(buf) > MAX_PART_HEAD:
                raise HTTPError(400, "multipart part headers too large")
            await more()
        if buf.startswith(b"\r\n"):
            raw_head = b""
            del buf[:2]
        else:
            j = buf.find(b"\r\n\r\n")
            raw_head = bytes(buf[:j])
            del buf[: j + 4]
        headers: dict[str, str] = {}
        for line in raw_head.decode("utf-8", "surrogateescape").split("\r\n"):
            k, _, v = line.partition(":")
            if k:
                headers[k.strip().lower()] = v.strip()
        await on_part(headers)
        in_part = True


async def upload(req: Request, resp: Response, user: User, meta_store: Metadata) -> None:
    meta = {
        k[len(METADATA_HEADER) :].lower(): v
        for k, v in req.headers.items()
        if k.startswith(METADATA_HEADER) and len(k) > len(METADATA_HEADER)
    }
    ctype = req.header("content-type")
    media = ctype.split(";")[0].strip().lower()
    src = _Source(req)
    query_path = req.query.get("path") or None
    results: list[dict[str, Any]] = []
    seen: set[str] = set()

    def record(path: str) -> None:
        meta_store.replace(path, meta)
        item: dict[str, Any] = {"path": path, "name": os.path.basename(path), "type": "file"}
        if meta:
            item["metadata"] = dict(meta)
        results.append(item)

    if media.startswith("multipart/"):
        boundary = _header_params(";" + ctype.partition(";")[2]).get("boundary")
        if not boundary:
            raise HTTPError(400, "multipart boundary missing")
        current: list[_Writer | None] = [None]

        async def on_part(headers: dict[str, str]) -> None:
            name, filename = _part_filename(headers)
            if name != "file":
                current[0] = None
                return
            target = query_path or filename
            if not target:
                raise HTTPError(400, "no path given for an uploaded file")
            path = _resolve(target, user)
            if path in seen:
                raise HTTPError(400, f"you cannot upload multiple files to the same path '{path}'")
            seen.add(path)
            current[0] = _Writer(path, user)

        def on_data(data: bytes) -> None:
            w = current[0]
            if w is not None:
                w.write(data)

        def on_end() -> None:
            w = current[0]
            if w is not None:
                w.close()
                record(w.path)
                current[0] = None

        try:
            await _multipart(src, boundary, on_part, on_data, on_end)
        finally:
            if current[0] is not None:
                current[0].close()
    else:
        if not query_path:
            raise HTTPError(400, "path query parameter is required for raw body upload")
        w = _Writer(_resolve(query_path, user), user)
        try:
            while True:
                data = await src.read()
                if not data:
                    break
                w.write(data)
        finally:
            w.close()
        record(w.path)
    if not results:
        raise HTTPError(400, "no file in the request")
    await resp.send_json(200, results)
