"""The sandbox commands: `start`, `connect`, `exec`, `ls`, `rm`, `pause`, `resume`, `timeout`
and `inspect` (`info`, its old name, is a hidden alias)."""

from __future__ import annotations

import contextlib
import shlex
import sys
import threading
from collections.abc import Iterator
from typing import Annotated, Any

import typer

from ..domain import DEFAULT_TEMPLATE
from .client import ControlPlane
from .connect import ConnectError, run_with
from .errors import CliError
from .options import (
    AutoOutputOpt,
    CwdOpt,
    EnvOpt,
    OutputFormat,
    OutputOpt,
    QuietOpt,
    UserOpt,
    WatchOpt,
    note,
    pairs,
)
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


# What `exec` keeps its sandbox alive for, pushed forward every minute while it runs.
EXEC_KEEPALIVE = 300


@contextlib.contextmanager
def keep_alive(state: CliState, sandbox_id: str, seconds: int = EXEC_KEEPALIVE) -> Iterator[None]:
    """While the block runs, push the sandbox's end to at least `seconds` from now, at once
    and then every `_keepalive_interval(seconds)` (connect only extends, never shortens;
    failures are ignored: the command's own stream reports a sandbox that is gone)."""
    stop = threading.Event()

    def run() -> None:
        with contextlib.suppress(CliError), state.control() as cp:
            while True:
                with contextlib.suppress(CliError):
                    cp.connect(sandbox_id, seconds)
                if stop.wait(_keepalive_interval(seconds)):
                    return

    thread = threading.Thread(target=run, name="aenv-keepalive", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=2.0)


def start(
    ctx: typer.Context,
    template: Annotated[
        str | None, typer.Argument(help="Template name or ID (default: base).")
    ] = None,
    cold: Annotated[
        str | None,
        typer.Option(
            "--cold",
            metavar="IMAGE",
            help="Start straight from an OCI image instead of a template (pulled first, "
            "with progress).",
        ),
    ] = None,
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
    """Create a sandbox and open an interactive shell in it (removed when the shell exits).

    The shell runs on a PTY: the terminal is raw while attached, window resizes are
    forwarded, and it is restored when the shell exits, fails or is cut off. The sandbox
    is kept alive while the shell is attached. With stdin not a terminal, stdin is typed
    into the shell, then ^D.

    Examples:

    ```
    aenv start                                 # a shell in a fresh `base` sandbox
    aenv start python-3 --cpu 2 --memory 2048 -e DEBUG=1 -m team=ml
    aenv start -d --timeout 3600               # print the id, leave it running
    aenv start --cold python:3.12-slim         # from an image, no template needed
    aenv start --keep -v data:/mnt/data        # keep it after exit; mount a volume
    ```
    """
    state = state_of(ctx)
    if cold and template:
        raise CliError("give a TEMPLATE or --cold IMAGE, not both")
    if cold and volume:
        raise CliError("--volume is not available with --cold")
    label = cold or template or DEFAULT_TEMPLATE
    body: dict[str, Any] = {
        "timeout": timeout,
        "metadata": pairs(metadata, "--metadata"),
        "envVars": pairs(env, "--env"),
    }
    if cold:
        body["image"] = cold
    else:
        body["templateID"] = template or DEFAULT_TEMPLATE
    if cpu is not None:
        body["cpuCount"] = cpu
    if memory is not None:
        body["memoryMB"] = memory
    if auto_pause:
        body["autoPause"] = True
    if volume:
        body["volumeMounts"] = mount_specs(volume)
    with state.control() as cp:
        sandbox = _create_cold(cp, body) if cold else cp.create_sandbox(body)
        sandbox_id = str(sandbox["sandboxID"])
        if detach:
            print(sandbox_id)
            return
        token = sandbox.get("envdAccessToken")
        code = 1
        try:
            if _stdin_is_tty():
                note(
                    f"sandbox {sandbox_id} ({label}); "
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


def _create_cold(cp: ControlPlane, body: dict[str, Any]) -> dict[str, Any]:
    """`POST /sandboxes-cold`, after pulling the image with a progress bar (the create then
    finds its layers cached; it does not report progress itself)."""
    from .templates import pull_image

    pulled = pull_image(cp, str(body["image"]))
    ref, digest = str(pulled.get("reference") or body["image"]), str(pulled.get("digest") or "")
    if digest:  # exactly what was pulled, even if the tag moves meanwhile
        body = dict(body, image=f"{ref.partition('@')[0]}@{digest}")
    return cp.create_cold_sandbox(body)


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

    return run_with(
        state.envd(sandbox_id, token, user),
        lambda envd: attach_shell(
            envd, cwd=cwd, keepalive=keepalive, keepalive_interval=_keepalive_interval(timeout)
        ),
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
    """Open an interactive shell in an existing sandbox (resumes it if paused).

    The sandbox is kept alive while attached; it keeps running after the shell exits.

    Examples:

    ```
    aenv connect i1a2b3c4d5
    aenv connect i1a2b3c4d5 -u root -w /etc
    ```
    """
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
                forward = (not _stdin_is_tty()) if stdin is None else stdin
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
    output: AutoOutputOpt = None,
    quiet: QuietOpt = False,
    watch: WatchOpt = False,
) -> None:
    """List sandboxes: a table on a terminal, JSON when piped (or as -o says).

    Examples:

    ```
    aenv ls
    aenv ls -s paused -o wide
    aenv ls -m team=ml -m env=dev -o yaml
    aenv ls -q | xargs aenv rm          # IDs only
    aenv ls -w                          # redraw on change until Ctrl-C
    ```
    """
    from .output import SANDBOXES, resolve_format
    from .watch import show_listing

    if state_filter:
        states = [s.strip() for s in state_filter.split(",") if s.strip()]
        bad = [s for s in states if s not in _STATES]
        if bad or not states:
            raise CliError(f"--state takes running, paused or both, got {state_filter!r}")
        state_filter = ",".join(states)
    meta = pairs(metadata, "--metadata")
    fmt = resolve_format(output, piped=OutputFormat.json)
    with state_of(ctx).control() as cp:
        show_listing(
            lambda: cp.list_sandboxes(state=state_filter, metadata=meta),
            SANDBOXES,
            fmt,
            quiet,
            watch,
        )


def rm(
    ctx: typer.Context,
    sandbox_ids: Annotated[list[str], typer.Argument(metavar="ID...", help="Sandbox IDs.")],
) -> None:
    """Remove (kill) sandboxes; prints each removed ID.

    Examples:

    ```
    aenv rm i1a2b3c4d5
    aenv ls -s paused -q | xargs aenv rm
    ```
    """
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
    """Pause a running sandbox (memory and filesystem are kept).

    Examples:

    ```
    aenv pause i1a2b3c4d5
    ```
    """
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
    """Resume a paused sandbox (a no-op for a running one).

    Examples:

    ```
    aenv resume i1a2b3c4d5 --timeout 600
    ```
    """
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
    """Set a sandbox's remaining lifetime.

    Examples:

    ```
    aenv timeout i1a2b3c4d5 3600
    ```
    """
    with state_of(ctx).control() as cp:
        cp.set_timeout(sandbox_id, seconds)
    print(sandbox_id)


def inspect(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox ID.")],
    output: OutputOpt = OutputFormat.table,
) -> None:
    """Show a sandbox's details.

    Examples:

    ```
    aenv inspect i1a2b3c4d5
    aenv inspect i1a2b3c4d5 -o json | jq .endAt
    aenv inspect i1a2b3c4d5 -o yaml
    ```
    """
    from .output import info_table, print_document

    with state_of(ctx).control() as cp:
        data = cp.get_sandbox(sandbox_id)
    print_document(data, output, info_table)
