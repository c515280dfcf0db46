"""The CLI's error types: an expected failure, shown as one `aenv: <message>` line, and the
exit code it ends with.

Exit codes follow docker's convention where a command's own code is passed through (`exec`,
`start`, `connect`: their exit code is the sandboxed command's), so a script can tell aenv's
failures from the command's:

- 125: aenv itself failed (server unreachable, an API error, a usage mistake);
- 126: the command could not be invoked (envd refused to start it: not executable,
  permission denied, a bad working directory or user);
- 127: the command was not found in the sandbox;
- anything else: the command's own exit code (128+N for signal N; 124 for `--timeout`).

Elsewhere (`ls`, `rm`, ...) there is no command's code to confuse it with: a failure exits 1
and a usage mistake 2, as before and as most CLIs (docker's own `ps`, `rm`) do.
"""

from __future__ import annotations

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_AENV = 125
EXIT_CANNOT_INVOKE = 126
EXIT_NOT_FOUND = 127


class CliError(Exception):
    """An expected failure (server error, unreachable server, bad input).

    The command group prints ``aenv: <message>`` on stderr and exits with `exit_code`;
    no traceback. `status` is the HTTP status when the error came from the server.
    `exit_code` None (the default) is "aenv failed": 1, or 125 in a command that passes a
    sandboxed command's exit code through (`exit_code_in`).
    """

    default_exit_code: int | None = None

    def __init__(
        self, message: str, *, exit_code: int | None = None, status: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = one_line(message)
        self.exit_code = self.default_exit_code if exit_code is None else exit_code
        self.status = status

    def exit_code_in(self, passes_exit_code: bool) -> int:
        """The exit code for this error in a command that does (or does not) pass a
        command's own code through."""
        if self.exit_code is not None:
            return self.exit_code
        return EXIT_AENV if passes_exit_code else EXIT_FAILURE


class CannotInvoke(CliError):
    """The sandboxed command could not be started (docker's 126)."""

    default_exit_code = EXIT_CANNOT_INVOKE


class CommandNotFound(CannotInvoke):
    """The sandboxed command's program does not exist (docker's 127)."""

    default_exit_code = EXIT_NOT_FOUND


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
        "cryptography",
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
