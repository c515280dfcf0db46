"""A small synchronous client for aenv's control plane (E2B REST, protocol §2)."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import quote, urlencode

import httpx

from ..envd_errors import answer_message
from .errors import CliError

USER_AGENT = "aenv-cli"


# What an error answer says: one reading for the control plane and envd alike.
server_message = answer_message


def transport_error(url: str, exc: httpx.TransportError) -> CliError:
    """Map a connection-level failure to one line naming the server URL."""
    if isinstance(exc, httpx.TimeoutException):
        return CliError(
            f"timed out talking to the aenv server at {url}: {exc or type(exc).__name__}"
        )
    reason = str(exc) or type(exc).__name__
    return CliError(f"cannot reach the aenv server at {url}: {reason}")


class ControlPlane:
    """The control-plane routes the CLI uses. Every method raises `CliError` on failure,
    carrying the server's message."""

    def __init__(
        self,
        url: str,
        api_key: str | None,
        *,
        timeout: float = 60.0,
        key_hint: str | None = None,
        transport: httpx.BaseTransport | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.url = url.rstrip("/")
        self._key_hint = key_hint
        headers = {"User-Agent": USER_AGENT}
        if api_key:
            headers["X-API-KEY"] = api_key
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport, verify=verify
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | tuple[tuple[str, str], ...] | None = None,
        ok: Iterable[int] = (200,),
        timeout: float | None = None,
    ) -> httpx.Response:
        """`timeout`: seconds to wait for the answer, for calls known to take long (the
        client's default otherwise)."""
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        try:
            resp = self._http.request(method, path, json=json, params=params, **extra)
        except httpx.TransportError as exc:
            raise transport_error(self.url, exc) from None
        if resp.status_code in set(ok):
            return resp
        msg = server_message(resp)
        if resp.status_code == 401:
            msg = f"{msg}; {self._key_hint}" if self._key_hint else msg
        raise CliError(msg, status=resp.status_code)

    @contextlib.contextmanager
    def stream(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: tuple[tuple[str, str], ...] | None = None,
        ok: Iterable[int] = (200,),
    ) -> Iterator[httpx.Response]:
        """A streamed answer (read it inside the `with`); errors as in `request`."""
        try:
            with self._http.stream(
                method, path, json=json, params=params, timeout=httpx.Timeout(60.0, read=None)
            ) as resp:
                if resp.status_code not in set(ok):
                    resp.read()
                    raise CliError(server_message(resp), status=resp.status_code)
                yield resp
        except httpx.TransportError as exc:
            raise transport_error(self.url, exc) from None

    @staticmethod
    def _json(resp: httpx.Response) -> Any:
        try:
            return resp.json()
        except ValueError:
            raise CliError(
                f"unexpected non-JSON answer from the server ({resp.status_code})"
            ) from None

    # -- sandboxes ------------------------------------------------------------------------

    def create_sandbox(self, body: dict[str, Any]) -> dict[str, Any]:
        data = self._json(self.request("POST", "/v2/sandboxes", json=body, ok=(201, 200)))
        if not isinstance(data, dict) or "sandboxID" not in data:
            raise CliError("the server's create answer has no sandboxID")
        return data

    def create_cold_sandbox(self, body: dict[str, Any]) -> dict[str, Any]:
        """`POST /sandboxes-cold`: a sandbox straight from an OCI image (`body["image"]`)."""
        resp = self.request("POST", "/sandboxes-cold", json=body, ok=(201, 200), timeout=600.0)
        data = self._json(resp)
        if not isinstance(data, dict) or "sandboxID" not in data:
            raise CliError("the server's create answer has no sandboxID")
        return data

    def list_sandboxes(
        self, *, state: str | None = None, metadata: Mapping[str, str] | None = None
    ) -> list[dict[str, Any]]:
        params: dict[str, str] = {}
        if state:
            params["state"] = state
        if metadata:
            params["metadata"] = urlencode(dict(metadata))
        out: list[dict[str, Any]] = []
        for _ in range(10_000):  # a bound on pages, in case a server loops
            resp = self.request("GET", "/v2/sandboxes", params=params)
            page = self._json(resp)
            if not isinstance(page, list):
                raise CliError("the server's list answer is not a JSON array")
            out.extend(page)
            token = resp.headers.get("x-next-token")
            if not token or not page:
                break
            params["nextToken"] = token
        return out

    def get_sandbox(self, sandbox_id: str) -> dict[str, Any]:
        data = self._json(self.request("GET", f"/sandboxes/{url_segment(sandbox_id)}"))
        if not isinstance(data, dict):
            raise CliError("the server's info answer is not a JSON object")
        return data

    def lineage(self, sandbox_id: str) -> dict[str, Any]:
        path = f"/sandboxes/{url_segment(sandbox_id)}/lineage"
        data = self._json(self.request("GET", path))
        if not isinstance(data, dict):
            raise CliError("the server's lineage answer is not a JSON object")
        return data

    def kill(self, sandbox_id: str) -> None:
        self.request("DELETE", f"/sandboxes/{url_segment(sandbox_id)}", ok=(204, 200))

    def bulk(
        self, method: str, path: str, metadata: Mapping[str, str], json: Any = None
    ) -> dict[str, Any]:
        """A bulk lifecycle call (`DELETE /sandboxes`, `POST /sandboxes/pause`) on the
        sandboxes matching `metadata`: the server's `{"sandboxIDs", "failed"}`."""
        resp = self.request(method, path, params={"metadata": urlencode(dict(metadata))}, json=json)
        data = self._json(resp)
        if not isinstance(data, dict):
            raise CliError("the server's bulk answer is not a JSON object")
        return data

    def pause(self, sandbox_id: str) -> None:
        self.request("POST", f"/sandboxes/{url_segment(sandbox_id)}/pause", json={}, ok=(204, 200))

    def connect(self, sandbox_id: str, timeout: int | None = None) -> dict[str, Any]:
        """Resume a paused sandbox (or just look up a running one) and return its
        `Sandbox` record, envdAccessToken included."""
        body: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        resp = self.request(
            "POST", f"/v2/sandboxes/{url_segment(sandbox_id)}/connect", json=body, ok=(200, 201)
        )
        data = self._json(resp)
        if not isinstance(data, dict):
            raise CliError("the server's connect answer is not a JSON object")
        return data

    def set_timeout(self, sandbox_id: str, timeout: int) -> None:
        self.request(
            "POST",
            f"/sandboxes/{url_segment(sandbox_id)}/timeout",
            json={"timeout": timeout},
            ok=(204, 200),
        )

    # -- templates ------------------------------------------------------------------------

    def list_templates(self) -> list[dict[str, Any]]:
        try:
            resp = self.request("GET", "/templates")
        except CliError as exc:
            if exc.status in (404, 405):
                raise CliError("this aenv server does not list templates yet") from None
            raise
        data = self._json(resp)
        if not isinstance(data, list):
            raise CliError("the server's template list is not a JSON array")
        return data


def url_segment(value: str) -> str:
    """One URL path segment."""
    return quote(value, safe="")
