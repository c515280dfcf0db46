"""envd's Connect wire format (JSON codec), shared by every client of envd: the one envd
client of the node and the CLI (`envd_client.py`) and the bench (`bench/client.py`).

Pure: no I/O and no HTTP client, so the async client and the bench's own sync calls drive
the same codec. A server stream is a run of envelopes (a flag byte, a 4-byte big-endian length, the
JSON message); the last one carries `FLAG_END_STREAM` and holds `{}` or
`{"error": {"code", "message"}}`. Unary calls are plain JSON bodies whose errors are
`{"code", "message"}` with an HTTP status. proto3 JSON: `bytes` travel as base64 and zero
values are omitted, so a missing field means 0, "" or false.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

# Re-exported: clients of envd take the port from here or from domain, never a literal.
from .domain import ENVD_PORT as ENVD_PORT

PROCESS_START = "process.Process/Start"
PROCESS_SEND_INPUT = "process.Process/SendInput"
PROCESS_SEND_SIGNAL = "process.Process/SendSignal"
PROCESS_CLOSE_STDIN = "process.Process/CloseStdin"
PROCESS_UPDATE = "process.Process/Update"
FILESYSTEM_MAKE_DIR = "filesystem.Filesystem/MakeDir"

CONNECT_PROTOCOL_VERSION = "1"
STREAM_CONTENT_TYPE = "application/connect+json"
UNARY_CONTENT_TYPE = "application/json"
ACCESS_TOKEN_HEADER = "X-Access-Token"

FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
_HEADER = struct.Struct(">BI")
# A sanity bound on one message (a corrupt length would otherwise buffer without end);
# envd's own chunks are far smaller.
MAX_MESSAGE = 64 << 20


class WireError(Exception):
    """A Connect error envd answered, or a stream that breaks the wire format. `code` is the
    Connect code string ("not_found", "internal", ...); each client maps it to its own
    error type."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(message or code)
        self.code = code
        self.message = message


# -- headers ----------------------------------------------------------------------------------


def auth_headers(token: str | None, user: str | None = None) -> dict[str, str]:
    """The sandbox's access token, and the user a call runs as: envd reads the user from a
    Basic authorization with an empty password, as E2B's SDK sends it."""
    headers: dict[str, str] = {}
    if token:
        headers[ACCESS_TOKEN_HEADER] = token
    if user:
        headers["Authorization"] = "Basic " + b64encode(f"{user}:".encode())
    return headers


def call_headers(*, stream: bool, timeout_ms: int | None = None) -> dict[str, str]:
    """Connect headers of one RPC: a server stream (envelopes) or a unary call (plain JSON)."""
    headers = {
        "Connect-Protocol-Version": CONNECT_PROTOCOL_VERSION,
        "Content-Type": STREAM_CONTENT_TYPE if stream else UNARY_CONTENT_TYPE,
    }
    if timeout_ms:
        headers["Connect-Timeout-Ms"] = str(timeout_ms)
    return headers


def route_headers(sandbox_id: str, port: int = ENVD_PORT) -> dict[str, str]:
    """How a client that reaches envd through the aenv server's one port names the sandbox
    and the port inside it."""
    return {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port)}


# -- envelopes --------------------------------------------------------------------------------


class Envelope(NamedTuple):
    flags: int
    payload: bytes

    @property
    def end_stream(self) -> bool:
        return bool(self.flags & FLAG_END_STREAM)


def encode_envelope(message: Mapping[str, Any], flags: int = 0) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(flags, len(payload)) + payload


class EnvelopeDecoder:
    """Incremental: feed bytes as they arrive (split anywhere), get whole envelopes back."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Envelope]:
        self._buf += data
        out: list[Envelope] = []
        while len(self._buf) >= _HEADER.size:
            flags, length = _HEADER.unpack_from(self._buf)
            if length > MAX_MESSAGE:
                raise WireError("resource_exhausted", f"stream message of {length} bytes")
            end = _HEADER.size + length
            if len(self._buf) < end:
                break
            out.append(Envelope(flags, bytes(self._buf[_HEADER.size : end])))
            del self._buf[:end]
        return out

    @property
    def pending(self) -> int:
        """Bytes held back: the start of an envelope not yet whole."""
        return len(self._buf)


class StreamReader:
    """The messages of one server stream, from its bytes as they arrive.

    `feed` returns the whole messages so far; once the end-of-stream envelope is read,
    `ended` is True (a clean end) or `feed` raised the `WireError` it carried. A stream
    that stops before its end envelope was cut short: the caller checks `ended`."""

    def __init__(self) -> None:
        self._decoder = EnvelopeDecoder()
        self.ended = False

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.ended:
            return out
        for env in self._decoder.feed(data):
            if env.flags & FLAG_COMPRESSED:
                raise WireError("internal", "compressed stream message")
            message = _json_object(env.payload)
            if env.end_stream:
                error = message.get("error")
                if error:
                    raise error_from_json(error)
                self.ended = True
                return out
            out.append(message)
        return out


def _json_object(payload: bytes) -> dict[str, Any]:
    if not payload:
        return {}
    try:
        obj = json.loads(payload)
    except ValueError:
        raise WireError("internal", "malformed JSON in a stream message") from None
    return obj if isinstance(obj, dict) else {}


# -- errors -----------------------------------------------------------------------------------

# Connect's mapping of HTTP statuses to codes, for answers without a Connect error body
# (e.g. the aenv proxy's own 410 for a paused sandbox).
_STATUS_CODES = {
    400: "invalid_argument",
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    408: "deadline_exceeded",
    409: "already_exists",
    410: "failed_precondition",
    413: "resource_exhausted",
    429: "resource_exhausted",
    499: "canceled",
    501: "unimplemented",
    502: "unavailable",
    503: "unavailable",
    504: "deadline_exceeded",
}


def code_for_status(status: int) -> str:
    return _STATUS_CODES.get(status, "unknown")


def error_code(status: int, body: bytes) -> str:
    """The Connect code of a non-200 answer: its error body's `code` when that is a Connect
    code string (aenv's own error bodies carry an integer), else the status's."""
    try:
        obj = json.loads(body) if body else None
    except ValueError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("code"), str) and obj["code"]:
        return str(obj["code"])
    return code_for_status(status)


def error_from_json(obj: Any, default: str = "unknown") -> WireError:
    """A Connect error object `{"code", "message"}` (either may be missing)."""
    if not isinstance(obj, dict):
        return WireError(default)
    code = obj.get("code")
    message = obj.get("message")
    return WireError(str(code) if code else default, str(message) if message else "")


# -- base64 (proto3 `bytes`) ------------------------------------------------------------------


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64decode(data: str) -> bytes:
    """proto3 JSON accepts standard or URL-safe base64, with or without padding."""
    s = data.replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(s + "=" * (-len(s) % 4))
    except (binascii.Error, ValueError):
        raise WireError("internal", "malformed base64 in a message") from None


# -- processes --------------------------------------------------------------------------------

EventKind = Literal["start", "stdout", "stderr", "pty", "end"]
_OUTPUTS: tuple[Literal["stdout", "stderr", "pty"], ...] = ("stdout", "stderr", "pty")


@dataclass(frozen=True)
class ProcessEvent:
    """One event of a process stream: `start` (pid), output (`stdout`, `stderr` or `pty`
    bytes), or `end` (exit code; `exited` is False when a signal or an error ended it, with
    `status` like "signal: killed" and `error` set when envd could not run it)."""

    kind: EventKind
    pid: int = 0
    data: bytes = b""
    exit_code: int = 0
    exited: bool = False
    status: str = ""
    error: str = ""


def parse_process_event(message: Mapping[str, Any]) -> ProcessEvent | None:
    """The event in one `process.Process/Start` (or `Connect`) stream message; None for
    keepalives, empty output and events this client does not know."""
    event = message.get("event")
    if not isinstance(event, dict):
        return None
    if "start" in event:
        return ProcessEvent("start", pid=_int(_object(event["start"]).get("pid"), 0))
    if "data" in event:
        data = _object(event["data"])
        for kind in _OUTPUTS:
            value = data.get(kind)
            if isinstance(value, str) and value:
                return ProcessEvent(kind, data=b64decode(value))
        return None
    if "end" in event:
        end = _object(event["end"])
        return ProcessEvent(
            "end",
            # An exit code that is not a number is as good as unknown (-1, like a signal).
            exit_code=_int(end.get("exitCode", end.get("exit_code")), -1),
            exited=bool(end.get("exited")),
            status=str(end.get("status") or ""),
            error=str(end.get("error") or ""),
        )
    return None


def start_request(
    cmd: str,
    args: list[str],
    *,
    envs: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdin: bool = False,
    pty_size: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """A `process.Process/Start` request; `pty_size` is (cols, rows) for a terminal."""
    process: dict[str, Any] = {"cmd": cmd, "args": list(args)}
    if envs:
        process["envs"] = dict(envs)
    if cwd:
        process["cwd"] = cwd
    request: dict[str, Any] = {"process": process}
    if stdin:
        request["stdin"] = True
    if pty_size is not None:
        cols, rows = pty_size
        request["pty"] = {"size": {"cols": cols, "rows": rows}}
    return request


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _int(value: Any, default: int) -> int:
    """proto3 JSON: a missing number is 0; int64 values may come as strings."""
    if value is None:
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        return default
