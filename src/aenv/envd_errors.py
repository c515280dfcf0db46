"""What a call to envd can fail with, whatever its layer (an envd or proxy answer, a broken
stream, no connection): one exception type for the node and the CLI to map to their own,
and the human message of an error answer."""

from __future__ import annotations

import httpx

from .envd_wire import WireError, error_code
from .errors import RuntimeFailure


class EnvdError(RuntimeFailure):
    """envd (or the proxy before it) refused a call, a stream broke off, or envd could not be
    reached — not: a process it ran failed. `code` is the Connect code ("not_found",
    "unavailable", ...), `http_status` the status of the answer when there was one; an
    unreachable envd has the httpx error as `__cause__`."""

    def __init__(self, code: str, message: str = "", *, http_status: int | None = None) -> None:
        super().__init__(message or code)
        self.code = code
        self.http_status = http_status

    @classmethod
    def of(cls, exc: WireError) -> EnvdError:
        return cls(exc.code, exc.message)

    @classmethod
    def answer(cls, resp: httpx.Response, context: str = "") -> EnvdError:
        """A non-2xx answer: a Connect error body, an aenv `{code:int, message}` body from
        the proxy (e.g. 410 for a paused sandbox), or anything else."""
        message = answer_message(resp)
        return cls(
            error_code(resp.status_code, resp.content),
            f"{context}: {message}" if context else message,
            http_status=resp.status_code,
        )


class EnvdUnreachable(EnvdError):
    """No answer: no connection to envd (or to the server before it), a timeout, or a
    connection that broke off; the httpx error is the `__cause__`."""


def answer_message(resp: httpx.Response) -> str:
    """The human message of an error answer: E2B or Connect `{code, message}`, or the status
    line plus the start of a body that is not JSON."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        msg = body.get("message") or body.get("detail") or body.get("error")
        if isinstance(msg, str) and msg.strip():
            return msg
        if isinstance(msg, dict | list):
            return str(msg)
    text = resp.text.strip()
    status = f"{resp.status_code} {resp.reason_phrase}".strip()
    return f"{status}: {text[:200]}" if text else status
