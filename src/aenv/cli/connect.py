"""A minimal Connect-RPC client (JSON codec) for envd, over httpx (protocol §3.1).

Every request goes to the aenv server's single port and is routed to the sandbox by the
`E2b-Sandbox-Id` / `E2b-Sandbox-Port` headers. Server streams use envelopes: one flag
byte, a 4-byte big-endian length, then the JSON payload; flag 0x02 marks the end-of-stream
message, `{}` or `{"error": {"code", "message"}}`. `bytes` fields travel as base64.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from typing import Any

import httpx

from .client import USER_AGENT, server_message, transport_error
from .errors import CliError

ENVD_PORT = 49983
FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
_HEADER = struct.Struct(">BI")
# A sanity bound on one message; envd's own chunks are far smaller.
MAX_MESSAGE = 64 << 20


class ConnectError(CliError):
    """A Connect error (`code` is the Connect code string, e.g. "not_found")."""

    def __init__(self, code: str, message: str, *, status: int | None = None) -> None:
        super().__init__(f"{message} ({code})" if message else code, status=status)
        self.code = code


def encode_envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(flags, len(payload)) + payload


class EnvelopeDecoder:
    """Incremental decoder: feed bytes as they arrive, get whole envelopes back."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buf += data
        out: list[tuple[int, bytes]] = []
        while len(self._buf) >= _HEADER.size:
            flags, length = _HEADER.unpack_from(self._buf)
            if length > MAX_MESSAGE:
                raise ConnectError("resource_exhausted", f"stream message of {length} bytes")
            end = _HEADER.size + length
            if len(self._buf) < end:
                break
            out.append((flags, bytes(self._buf[_HEADER.size : end])))
            del self._buf[:end]
        return out

    @property
    def pending(self) -> int:
        return len(self._buf)


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64decode(data: str) -> bytes:
    # proto3 JSON accepts standard or URL-safe base64, with or without padding.
    s = data.replace("-", "+").replace("_", "/")
    return base64.b64decode(s + "=" * (-len(s) % 4))


def _error_from_json(obj: Any, default: str) -> ConnectError:
    if isinstance(obj, dict):
        code = obj.get("code")
        message = obj.get("message")
        return ConnectError(
            str(code) if code is not None else default,
            str(message) if message else "",
        )
    return ConnectError(default, "")


def _http_code(status: int) -> str:
    return {
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
    }.get(status, "unknown")


def _response_error(resp: httpx.Response) -> ConnectError:
    """A non-200 answer: a Connect error body, an aenv `{code:int, message}` body from the
    proxy (e.g. 410 for a paused sandbox), or anything else."""
    code = _http_code(resp.status_code)
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("code"), str):
        code = body["code"]
    return ConnectError(code, server_message(resp), status=resp.status_code)


class EnvdClient:
    """Connect-RPC calls to one sandbox's envd."""

    def __init__(
        self,
        url: str,
        sandbox_id: str,
        access_token: str | None,
        *,
        user: str | None = None,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.sandbox_id = sandbox_id
        self._args = (url, sandbox_id, access_token)
        self._kwargs: dict[str, Any] = {"user": user, "timeout": timeout, "transport": transport}
        headers = {
            "User-Agent": USER_AGENT,
            "E2b-Sandbox-Id": sandbox_id,
            "E2b-Sandbox-Port": str(ENVD_PORT),
            "Connect-Protocol-Version": "1",
        }
        if access_token:
            headers["X-Access-Token"] = access_token
        if user:
            headers["Authorization"] = "Basic " + b64encode(f"{user}:".encode())
        self._timeout = timeout
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )

    def clone(self) -> EnvdClient:
        """A second client with the same settings (for calls from another thread)."""
        return EnvdClient(*self._args, **self._kwargs)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EnvdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def unary(self, method: str, message: dict[str, Any]) -> dict[str, Any]:
        """`method` is `package.Service/Method`, e.g. `process.Process/SendInput`."""
        try:
            resp = self._http.post(
                f"/{method}",
                content=json.dumps(message, separators=(",", ":")).encode(),
                headers={"Content-Type": "application/json"},
            )
        except httpx.TransportError as exc:
            raise transport_error(self.url, exc) from None
        if resp.status_code != 200:
            raise _response_error(resp)
        try:
            data = resp.json()
        except ValueError:
            raise ConnectError("internal", f"{method}: answer is not JSON") from None
        return data if isinstance(data, dict) else {}

    def stream(
        self, method: str, message: dict[str, Any], *, timeout_ms: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """A server-streaming call: yields each response message as it arrives; raises
        `ConnectError` for an end-of-stream error or a stream cut short."""
        headers = {"Content-Type": "application/connect+json", "Keepalive-Ping-Interval": "50"}
        if timeout_ms:
            headers["Connect-Timeout-Ms"] = str(timeout_ms)
        # Reads may be idle for long (an interactive shell); envd sends keepalives.
        timeout = httpx.Timeout(self._timeout, read=None)
        decoder = EnvelopeDecoder()
        try:
            with self._http.stream(
                "POST",
                f"/{method}",
                content=encode_envelope(message),
                headers=headers,
                timeout=timeout,
            ) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise _response_error(resp)
                ctype = resp.headers.get("content-type", "")
                if ctype.startswith("application/json"):
                    # A unary-style error answer with status 200 is not valid, but be clear.
                    resp.read()
                    raise _error_from_json(_safe_json(resp.content), "unknown")
                for chunk in resp.iter_bytes():
                    for flags, payload in decoder.feed(chunk):
                        if flags & FLAG_COMPRESSED:
                            raise ConnectError("internal", "compressed stream message")
                        obj = _safe_json(payload)
                        if flags & FLAG_END_STREAM:
                            if isinstance(obj, dict) and obj.get("error"):
                                raise _error_from_json(obj["error"], "unknown")
                            return
                        if isinstance(obj, dict):
                            yield obj
        except httpx.TransportError as exc:
            raise transport_error(self.url, exc) from None
        raise ConnectError(
            "unavailable", f"{method}: stream ended without an end-of-stream message"
        )


def _safe_json(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        raise ConnectError("internal", "malformed JSON in a stream message") from None
