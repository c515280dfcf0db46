"""One error hierarchy, mapped once to E2B's `{code, message}` JSON and HTTP statuses.

Routes and services raise these; the API layer turns them into responses, the CLI into
one-line messages. Nothing formats errors by hand.
"""

from __future__ import annotations

import math


class AenvError(Exception):
    status: int = 500

    def __init__(
        self, message: str, *, error_code: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.error_code = error_code
        # Seconds after which the same request may succeed (a busy node): sent as the
        # `Retry-After` header of the error response.
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        """The response headers that go with the error's JSON body."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}

    def to_json(self) -> dict[str, object]:
        body: dict[str, object] = {"code": self.status, "message": self.message}
        if self.error_code:
            body["error_code"] = self.error_code
        return body


class BadRequest(AenvError):
    status = 400


class Unauthorized(AenvError):
    status = 401


class Forbidden(AenvError):
    status = 403


class NotFound(AenvError):
    status = 404


class Conflict(AenvError):
    status = 409


class PathConflict(Conflict):
    """Both sides changed the same paths (`POST /sandboxes/{id}/apply`): they are listed."""

    def __init__(self, message: str, paths: list[str]) -> None:
        super().__init__(message, error_code="conflict")
        self.paths = paths

    def to_json(self) -> dict[str, object]:
        return {**super().to_json(), "paths": self.paths}


class TooManyRequests(AenvError):
    status = 429


class InternalError(AenvError):
    status = 500


class BadGateway(AenvError):
    status = 502


class SandboxNotFound(BadGateway):
    """The data plane's answer for a sandbox it cannot route to (unknown, killed, timed out,
    or paused without auto-resume), in the words of E2B's edge proxy: the SDKs read this 502
    as "not running" (`is_running()` is False, a broken-off stream says the sandbox was
    killed). `state` tells a paused sandbox from a gone one; E2B's body has no such field."""

    MESSAGE = "The sandbox was not found"

    def __init__(self, sandbox_id: str, *, state: str | None = None) -> None:
        super().__init__(self.MESSAGE)
        self.sandbox_id = sandbox_id
        self.state = state

    def to_json(self) -> dict[str, object]:
        body: dict[str, object] = {
            "code": self.status,
            "message": self.MESSAGE,
            "sandboxId": self.sandbox_id,
        }
        if self.state:
            body["state"] = self.state
        return body


class Unavailable(AenvError):
    status = 503


class GatewayTimeout(AenvError):
    status = 504


class InsufficientStorage(AenvError):
    status = 507


class RuntimeFailure(InternalError):
    """A runtime (runsc, netns, mount) operation failed; the message carries its stderr."""
