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


# The top-level modules that only the `server` extra installs (pyproject.toml; starlette
# comes with fastapi). A command that runs node code in-process (`aenv server`, `gateway`,
# `template build-base`) fails on one of them in a client-only install.
SERVER_MODULES = frozenset(
    {
        "fastapi",
        "starlette",
        "uvicorn",
        "websockets",
        "prometheus_client",
        "zstandard",
        "obstore",
        "redis",
    }
)


def missing_server_extra(exc: ModuleNotFoundError, distribution: str) -> str | None:
    """The one-line hint for a server package missing from a client-only install, or None
    when the missing module is not one of them (a bug, reported as such)."""
    name = (exc.name or "").partition(".")[0]
    if name not in SERVER_MODULES:
        return None
    return (
        f"this command runs server code, which needs the server's packages (no module named "
        f"{name!r}): pip install '{distribution}[server]'"
    )
