"""The CLI's one error type: an expected failure, shown as one `aenv: <message>` line."""

from __future__ import annotations


class CliError(Exception):
    """An expected failure (server error, unreachable server, bad input).

    The command group prints ``aenv: <message>`` on stderr and exits with `exit_code`;
    no traceback. `status` is the HTTP status when the error came from the server.
    """

    def __init__(self, message: str, *, exit_code: int = 1, status: int | None = None) -> None:
        super().__init__(message)
        self.message = one_line(message)
        self.exit_code = exit_code
        self.status = status


def one_line(text: str) -> str:
    """Collapse a (possibly multi-line) message into one line."""
    parts = [p.strip() for p in str(text).strip().splitlines()]
    return " | ".join(p for p in parts if p) or "unknown error"
