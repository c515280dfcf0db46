"""The sandbox commands: `start`, `connect`, `exec`, `ls`, `rm`, `pause`, `resume`, `timeout`
and `info`."""

from __future__ import annotations

import shlex
import sys
from typing import Annotated, Any

import typer

from .client import ControlPlane
from .connect import ConnectError
from .errors import CliError
from .options import CwdOpt, EnvOpt, OutputFormat, OutputOpt, UserOpt, note, pairs
from .state import CliState, state_of
from .volumes import mount_specs


def _join_command(command: list[str]) -> str:
    """One argument is a shell command line as is (`aenv exec ID 'ls | wc -l'`); several
    are an argv, quoted for the shell (`aenv exec ID -- ls -la "my dir"`)."""
    if len(command) == 1:
        return command[0]
    return shlex.join(command)


def _stdin_is_tty() -> bool:
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False


def _keepalive_interval(timeout: int) -> float:
    return float(max(5, min(60, timeout // 3)))


def start(
    ctx: typer.Context,
    template: Annotated[str, typer.Argument(help="Template name or ID.")] = "base",
    detach: Annotated[
        bool, typer.Option("--detach", "-d", help="Print the sandbox ID and exit.")
    ] = False,
    timeout: Annotated[
        int,
        typer.Option(
            "--timeout",
            "-t",
            min=1,
            help="Seconds the sandbox lives (kept alive while a shell is attached).",
        ),
    ] = 300,
    cpu: Annotated[int | None, typer.Option("--cpu", min=1, help="vCPUs.")] = None,
    memory: Annotated[int | None, typer.Option("--memory", min=1, help="Memory in MB.")] = None,
    metadata: Annotated[
        list[str] | None,
        typer.Option("--metadata", "-m", metavar="KEY=VALUE", help="Metadata (repeatable)."),
    ] = None,
    env: EnvOpt = None,
    auto_pause: Annotated[
        bool, typer.Option("--auto-pause", help="Pause instead of kill at timeout.")
    ] = False,
    keep: Annotated[
        bool, typer.Option("--keep", help="Keep the sandbox when the shell exits.")
    ] = False,
    user: UserOpt = None,
    cwd: CwdOpt = None,
    volume: Annotated[
        list[str] | None,
        typer.Option(
            "--volume", "-v", metavar="NAME:/PATH[:ro]", help="Mount a volume (repeatable)."
        ),
    ] = None,
) -> None:
    """Create a sandbox and open an interactive shell in it (removed when the shell exits)."""
    state = state_of(ctx)
    body: dict[str, Any] = {
        "templateID": template,
        "timeout": timeout,
        "metadata": pairs(metadata, "--metadata"),
        "envVars": pairs(env, "--env"),
    }
    if cpu is not None:
        body["cpuCount"] = cpu
    if memory is not None:
        body["memoryMB"] = memory
    if auto_pause:
        body["autoPause"] = True
    if volume:
        body["volumeMounts"] = mount_specs(volume)
    with state.control() as cp:
        sandbox = cp.create_sandbox(body)
        sandbox_id = str(sandbox["sandboxID"])
        if detach:
            print(sandbox_id)
            return
        token = sandbox.get("envdAccessToken")
        code = 1
        try:
            if _stdin_is_tty():
                note(
                    f"sandbox {sandbox_id} ({template}); "
                    + ("it is kept" if keep else "it is removed")
                    + " when the shell exits"
                )
            code = _shell(state, cp, sandbox_id, token, timeout, user, cwd)
        finally:
            if keep:
                note(
                    f"sandbox {sandbox_id} kept; reconnect with `aenv connect {sandbox_id}`, "
                    f"remove with `aenv rm {sandbox_id}`"
                )
            else:
                try:
                    cp.kill(sandbox_id)
                except CliError as exc:
                    note(f"could not remove sandbox {sandbox_id}: {exc.message}")
    raise typer.Exit(code)


def _shell(
    state: CliState,
    cp: ControlPlane,
    sandbox_id: str,
    token: str | None,
    timeout: int,
    user: str | None,
    cwd: str | None,
) -> int:
    from .session import attach_shell

    def keepalive() -> None:
        cp.connect(sandbox_id, timeout)  # extends only, never shortens

    return attach_shell(
        lambda: state.envd(sandbox_id, token, user),
        cwd=cwd,
        keepalive=keepalive,
        keepalive_interval=_keepalive_interval(timeout),
    )


def connect_(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox ID.")],
    timeout: Annotated[
        int,
        typer.Option(
            "--timeout",
            "-t",
            min=1,
            help="Keep the sandbox alive at least this many seconds (extends only).",
        ),
    ] = 300,
    user: UserOpt = None,
    cwd: CwdOpt = None,
) -> None:
    """Open an interactive shell in an existing sandbox (resumes it if paused)."""
    state = state_of(ctx)
    with state.control() as cp:
        sandbox = cp.connect(sandbox_id, timeout)
        code = _shell(state, cp, sandbox_id, sandbox.get("envdAccessToken"), timeout, user, cwd)
    raise typer.Exit(code)


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
        bool, typer.Option("--stdin", "-i", help="Forward local stdin to the command.")
    ] = False,
    timeout: Annotated[
        int | None,
        typer.Option("--timeout", "-t", min=1, help="Kill the command after SECS seconds."),
    ] = None,
) -> None:
    """Run a command in a sandbox, streaming its output; exits with its exit code."""
    from .session import run_command

    state = state_of(ctx)
    envs = pairs(env, "--env")
    with state.control() as cp:
        info = cp.get_sandbox(sandbox_id)
    if info.get("state") == "paused":
        raise CliError(f"sandbox {sandbox_id} is paused; resume it with `aenv resume {sandbox_id}`")
    with state.envd(sandbox_id, info.get("envdAccessToken"), user) as envd:
        try:
            code = run_command(
                envd,
                _join_command(command),
                envs=envs,
                cwd=cwd,
                forward_stdin=stdin,
                timeout_ms=timeout * 1000 if timeout else None,
            )
        except ConnectError as exc:
            if timeout and exc.code == "deadline_exceeded":
                raise CliError(f"command timed out after {timeout}s", exit_code=124) from None
            raise
    raise typer.Exit(code)


_STATES = ("running", "paused")


def ls(
    ctx: typer.Context,
    state_filter: Annotated[
        str | None,
        typer.Option("--state", "-s", metavar="STATES", help="running, paused or running,paused."),
    ] = None,
    metadata: Annotated[
        list[str] | None,
        typer.Option(
            "--metadata", "-m", metavar="KEY=VALUE", help="Filter by metadata (repeatable)."
        ),
    ] = None,
    output: OutputOpt = OutputFormat.table,
) -> None:
    """List sandboxes."""
    from .output import print_listing, sandbox_table

    if state_filter:
        states = [s.strip() for s in state_filter.split(",") if s.strip()]
        bad = [s for s in states if s not in _STATES]
        if bad or not states:
            raise CliError(f"--state takes running, paused or both, got {state_filter!r}")
        state_filter = ",".join(states)
    with state_of(ctx).control() as cp:
        sandboxes = cp.list_sandboxes(state=state_filter, metadata=pairs(metadata, "--metadata"))
    print_listing(
        sandboxes, as_json=output is OutputFormat.json, empty="no sandboxes", table=sandbox_table
    )


def rm(
    ctx: typer.Context,
    sandbox_ids: Annotated[list[str], typer.Argument(metavar="ID...", help="Sandbox IDs.")],
) -> None:
    """Remove (kill) sandboxes; prints each removed ID."""
    failed = False
    with state_of(ctx).control() as cp:
        for sandbox_id in sandbox_ids:
            try:
                cp.kill(sandbox_id)
            except CliError as exc:
                if exc.status is None:  # the server is unreachable: stop here
                    raise
                failed = True
                msg = exc.message
                note(msg if sandbox_id in msg else f"{sandbox_id}: {msg}")
                continue
            print(sandbox_id, flush=True)
    if failed:
        raise typer.Exit(1)


def pause(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox ID.")],
) -> None:
    """Pause a running sandbox (memory and filesystem are kept)."""
    with state_of(ctx).control() as cp:
        cp.pause(sandbox_id)
    print(sandbox_id)


def resume(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox ID.")],
    timeout: Annotated[
        int | None,
        typer.Option("--timeout", "-t", min=1, help="Seconds to live from now."),
    ] = None,
) -> None:
    """Resume a paused sandbox (a no-op for a running one)."""
    with state_of(ctx).control() as cp:
        cp.connect(sandbox_id, timeout)
    print(sandbox_id)


def timeout_(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox ID.")],
    seconds: Annotated[
        int, typer.Argument(metavar="SECS", min=0, help="Seconds to live from now.")
    ],
) -> None:
    """Set a sandbox's remaining lifetime."""
    with state_of(ctx).control() as cp:
        cp.set_timeout(sandbox_id, seconds)
    print(sandbox_id)


def info(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox ID.")],
    output: OutputOpt = OutputFormat.table,
) -> None:
    """Show a sandbox's details."""
    from .output import info_table, print_json, print_table

    with state_of(ctx).control() as cp:
        data = cp.get_sandbox(sandbox_id)
    if output is OutputFormat.json:
        print_json(data)
    else:
        print_table(info_table(data))
