"""`aenv exec`: run a command in a sandbox, its output streamed (or on a PTY with `-t`), its
exit code aenv's; aenv's own failures exit 125, a command that cannot be invoked 126, one
not found 127 (errors.py)."""

from __future__ import annotations

import contextlib
import shlex
import threading
from collections.abc import Iterator
from typing import Annotated

import typer

from .connect import ConnectError, run_with
from .errors import CliError
from .options import CwdOpt, EnvOpt, UserOpt, note, pairs, stdin_is_tty
from .state import CliState, state_of


def _join_command(command: list[str]) -> str:
    """One argument is a shell command line as is (`aenv exec ID 'ls | wc -l'`); several
    are an argv, quoted for the shell (`aenv exec ID -- ls -la "my dir"`)."""
    if len(command) == 1:
        return command[0]
    return shlex.join(command)


def keepalive_interval(timeout: int) -> float:
    return float(max(5, min(60, timeout // 3)))


# What `exec` keeps its sandbox alive for, pushed forward every minute while it runs.
EXEC_KEEPALIVE = 300


@contextlib.contextmanager
def keep_alive(state: CliState, sandbox_id: str, seconds: int = EXEC_KEEPALIVE) -> Iterator[None]:
    """While the block runs, push the sandbox's end to at least `seconds` from now, at once
    and then every `keepalive_interval(seconds)` (connect only extends, never shortens;
    failures are ignored: the command's own stream reports a sandbox that is gone)."""
    stop = threading.Event()

    def run() -> None:
        with contextlib.suppress(CliError), state.control() as cp:
            while True:
                with contextlib.suppress(CliError):
                    cp.connect(sandbox_id, seconds)
                if stop.wait(keepalive_interval(seconds)):
                    return

    thread = threading.Thread(target=run, name="aenv-keepalive", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=2.0)


def exec_(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox ID.")],
    command: Annotated[
        list[str],
        typer.Argument(
            metavar="-- CMD...",
            help="The command: one argument is a shell line; several are an argv.",
        ),
    ],
    user: UserOpt = None,
    cwd: CwdOpt = None,
    env: EnvOpt = None,
    stdin: Annotated[
        bool | None,
        typer.Option(
            "--interactive/--no-interactive",
            "--stdin/--no-stdin",
            "-i/-I",
            help="Keep stdin open and forward it to the command (default: when stdin is "
            "not a terminal, and never with -t alone).",
            show_default=False,
        ),
    ] = None,
    tty: Annotated[
        bool,
        typer.Option(
            "--tty",
            "-t",
            help="Run the command on a PTY (raw terminal, resizes forwarded); -it for an "
            "interactive program, as with docker.",
        ),
    ] = False,
    timeout: Annotated[
        int | None,
        typer.Option("--timeout", min=1, metavar="SECS", help="Kill the command after SECS."),
    ] = None,
) -> None:
    """Run a command in a sandbox, streaming its output; exits with its exit code.

    Piped stdin is forwarded to the command (force with -i, turn off with -I). -t runs it
    on a PTY, -it interactively (`aenv exec -it ID bash`). The sandbox is kept alive while
    the command runs. One argument is a shell line; several are an argv.

    Exit codes: the command's own; 125 when aenv failed (server unreachable, sandbox not
    found, usage), 126 when the command could not be invoked, 127 when it was not found,
    124 after --timeout.

    Examples:

    ```
    aenv exec i1a2b3c4d5 -- ls -la /home/user
    aenv exec i1a2b3c4d5 'ps aux | grep python'
    echo 'print(6*7)' | aenv exec i1a2b3c4d5 -- python3 -
    aenv exec -it i1a2b3c4d5 bash
    aenv exec i1a2b3c4d5 -u root -w /etc -e LANG=C --timeout 30 -- cat os-release
    ```
    """
    from .session import run_command

    state = state_of(ctx)
    if tty:
        sandbox_id, command, timeout, tty = _legacy_timeout(sandbox_id, command, timeout)
    envs = pairs(env, "--env")
    line = _join_command(command)
    timeout_ms = timeout * 1000 if timeout else None
    envd = state.envd_of(sandbox_id, user)
    with keep_alive(state, sandbox_id):
        try:
            if tty:
                from .session import attach_shell

                code = run_with(
                    envd,
                    lambda envd: attach_shell(
                        envd,
                        args=("-l", "-c", line),
                        envs=envs,
                        cwd=cwd,
                        forward_stdin=bool(stdin),
                        timeout_ms=timeout_ms,
                    ),
                )
            else:
                forward = (not stdin_is_tty()) if stdin is None else stdin
                code = run_with(
                    envd,
                    lambda envd: run_command(
                        envd,
                        line,
                        envs=envs,
                        cwd=cwd,
                        forward_stdin=forward,
                        timeout_ms=timeout_ms,
                    ),
                )
        except ConnectError as exc:
            if timeout and exc.code == "deadline_exceeded":
                raise CliError(f"command timed out after {timeout}s", exit_code=124) from None
            raise
    raise typer.Exit(code)


def _legacy_timeout(
    sandbox_id: str, command: list[str], timeout: int | None
) -> tuple[str, list[str], int | None, bool]:
    """`-t` was `--timeout` before it was docker's `--tty`: `exec -t 30 ID CMD` and `exec ID
    -t 30 -- CMD` still mean a timeout (a sandbox ID or a command is never just digits),
    with a note. Returns (ID, command, timeout, tty)."""
    if sandbox_id.isdigit() and command:
        secs, sandbox_id, command = sandbox_id, command[0], command[1:]
    elif len(command) > 1 and command[0].isdigit():
        secs, command = command[0], command[1:]
    else:
        return sandbox_id, command, timeout, True
    if not command:
        raise CliError("no command given")
    note(f"`-t {secs}` is now `--timeout {secs}` (-t allocates a terminal, as in docker)")
    return sandbox_id, command, int(secs), False
