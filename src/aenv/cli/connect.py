"""How CLI commands drive envd: the one async client (`aenv.envd_client`), reached through the
aenv server's port, run to its end by each command, its failures the CLI's one-line errors."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from ..envd_client import EnvdClient
from ..envd_errors import EnvdError, EnvdUnreachable
from .errors import CliError

T = TypeVar("T")


class ConnectError(CliError):
    """A Connect error (`code` is the Connect code string, e.g. "not_found")."""

    def __init__(self, code: str, message: str, *, status: int | None = None) -> None:
        super().__init__(f"{message} ({code})" if message else code, status=status)
        self.code = code


def cli_error(exc: EnvdError, *, code: bool = True) -> CliError:
    """An envd failure as the CLI shows it: a server that could not be reached in its own
    words, an answer with its Connect code (unless `code` is False)."""
    if isinstance(exc, EnvdUnreachable) or not code:
        return CliError(exc.message, status=exc.http_status)
    return ConnectError(exc.code, exc.message, status=exc.http_status)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Runs a command's envd work to its end on an event loop of its own."""
    try:
        return asyncio.run(main)
    except EnvdError as exc:
        raise cli_error(exc) from None


def run_with(envd: EnvdClient, work: Callable[[EnvdClient], Awaitable[T]]) -> T:
    """`run` of `work(envd)`, the client closed after it on the same loop."""

    async def main() -> T:
        async with envd:
            return await work(envd)

    return run(main())
