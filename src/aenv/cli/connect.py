"""The CLI's synchronous Connect-RPC client for envd, over httpx (protocol §3.1).

Every request goes to the aenv server's single port and is routed to the sandbox by the
`E2b-Sandbox-Id` / `E2b-Sandbox-Port` headers. The wire format (envelopes, headers, events)
is `aenv.envd_wire`'s.
"""

from __future__ import annotations

import contextlib
import json
import ssl
from collections.abc import Iterator
from typing import IO, Any

import httpx

from ..envd_wire import (
    ProcessEvent,
    StreamReader,
    WireError,
    auth_headers,
    call_headers,
    encode_envelope,
    error_code,
    error_from_json,
    parse_process_event,
    route_headers,
)
from .client import USER_AGENT, server_message, transport_error
from .errors import CliError


class ConnectError(CliError):
    """A Connect error (`code` is the Connect code string, e.g. "not_found")."""

    def __init__(self, code: str, message: str, *, status: int | None = None) -> None:
        super().__init__(f"{message} ({code})" if message else code, status=status)
        self.code = code

    @classmethod
    def of(cls, exc: WireError) -> ConnectError:
        return cls(exc.code, exc.message)


def _response_error(resp: httpx.Response) -> ConnectError:
    """A non-200 answer: a Connect error body, an aenv `{code:int, message}` body from the
    proxy (e.g. 410 for a paused sandbox), or anything else."""
    return ConnectError(
        error_code(resp.status_code, resp.content), server_message(resp), status=resp.status_code
    )


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
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.url = url.rstrip("/")
        self.sandbox_id = sandbox_id
        self.user = user
        self._args = (url, sandbox_id, access_token)
        self._kwargs: dict[str, Any] = {
            "user": user,
            "timeout": timeout,
            "transport": transport,
            "verify": verify,
        }
        headers = {
            "User-Agent": USER_AGENT,
            **route_headers(sandbox_id),
            **auth_headers(access_token, user),
        }
        self._timeout = timeout
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport, verify=verify
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
                headers=call_headers(stream=False),
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
        headers = {
            **call_headers(stream=True, timeout_ms=timeout_ms),
            "Keepalive-Ping-Interval": "50",
        }
        # Reads may be idle for long (an interactive shell); envd sends keepalives.
        timeout = httpx.Timeout(self._timeout, read=None)
        reader = StreamReader()
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
                    raise ConnectError.of(error_from_json(_json_or_none(resp.content)))
                for chunk in resp.iter_bytes():
                    yield from reader.feed(chunk)
                    if reader.ended:
                        return
        except WireError as exc:
            raise ConnectError.of(exc) from None
        except httpx.TransportError as exc:
            raise transport_error(self.url, exc) from None
        raise ConnectError(
            "unavailable", f"{method}: stream ended without an end-of-stream message"
        )

    # -- envd's /files (plain HTTP beside the RPCs) ------------------------------------------

    def _file_params(self, path: str) -> dict[str, str]:
        params = {"path": path}
        if self.user:
            params["username"] = self.user
        return params

    def upload(self, path: str, data: IO[bytes], filename: str) -> None:
        """`POST /files?path=`: one file as a multipart part, as the E2B SDK writes it
        (streamed from `data`; envd creates the parents)."""
        try:
            resp = self._http.post(
                "/files",
                params=self._file_params(path),
                files={"file": (filename, data, "application/octet-stream")},
                timeout=httpx.Timeout(self._timeout, write=None, read=None),
            )
        except httpx.TransportError as exc:
            raise transport_error(self.url, exc) from None
        if resp.status_code != 200:
            raise CliError(f"{path}: {server_message(resp)}", status=resp.status_code)

    @contextlib.contextmanager
    def download(self, path: str) -> Iterator[httpx.Response]:
        """`GET /files?path=`: the file's bytes (read the answer inside the `with`)."""
        try:
            with self._http.stream(
                "GET",
                "/files",
                params=self._file_params(path),
                # Bytes as they are: no gzip work for envd, and the sizes stay true.
                headers={"Accept-Encoding": "identity"},
                timeout=httpx.Timeout(self._timeout, read=None),
            ) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise CliError(f"{path}: {server_message(resp)}", status=resp.status_code)
                yield resp
        except httpx.TransportError as exc:
            raise transport_error(self.url, exc) from None

    def process(
        self, method: str, message: dict[str, Any], *, timeout_ms: int | None = None
    ) -> Iterator[ProcessEvent]:
        """The events of a process stream (`process.Process/Start` or `Connect`)."""
        for msg in self.stream(method, message, timeout_ms=timeout_ms):
            try:
                event = parse_process_event(msg)
            except WireError as exc:
                raise ConnectError.of(exc) from None
            if event is not None:
                yield event


def _json_or_none(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        return None
