"""The sandbox commands: `start`, `connect`, `ls`, `rm`, `pause`, `resume`, `timeout`
and `inspect` (`info`, its old name, is a hidden alias); `exec` is in execute.py."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from typer import _click

from ..domain import DEFAULT_TEMPLATE
from .client import ControlPlane
from .connect import run_with
from .errors import CliError
from .execute import keepalive_interval
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
    stdin_is_tty,
)
from .state import CliState, state_of
from .volumes import mount_specs


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
            if stdin_is_tty():
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
            envd, cwd=cwd, keepalive=keepalive, keepalive_interval=keepalive_interval(timeout)
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


AllOpt = Annotated[
    bool,
    typer.Option("--all", help="Every sandbox matching --metadata (which is then required)."),
]
MatchOpt = Annotated[
    list[str] | None,
    typer.Option("--metadata", "-m", metavar="KEY=VALUE", help="With --all: match (repeatable)."),
]


def _bulk(
    ctx: typer.Context, method: str, path: str, metadata: list[str] | None, body: Any = None
) -> None:
    """One server call on every sandbox matching `metadata`: prints each affected ID, and
    fails (exit 1) if any sandbox could not be acted on."""
    meta = pairs(metadata, "--metadata")
    if not meta:  # the server refuses too; said here with the flag's name
        raise _click.exceptions.UsageError(
            "--all needs --metadata KEY=VALUE: it never means every sandbox"
        )
    with state_of(ctx).control() as cp:
        answer = cp.bulk(method, path, meta, body)
    for sandbox_id in answer.get("sandboxIDs") or []:
        print(sandbox_id, flush=True)
    failed = answer.get("failed") or []
    for f in failed:
        note(f"{f.get('sandboxID')}: {f.get('message')}")
    for node_id in answer.get("unreachableNodes") or []:
        note(f"node {node_id} was not reached: its sandboxes were left as they were")
    if failed or answer.get("unreachableNodes"):
        raise typer.Exit(1)


def _ids_or_all(ids: list[str] | None, all_: bool, metadata: list[str] | None) -> list[str]:
    """The IDs given, or none with `--all`; a wrong mix is a usage error (exit 2)."""
    if all_ and ids:
        raise _click.exceptions.UsageError(
            "give sandbox IDs or --all --metadata KEY=VALUE, not both"
        )
    if not all_ and metadata:
        raise _click.exceptions.UsageError("--metadata selects sandboxes only with --all")
    if not all_ and not ids:
        raise _click.exceptions.UsageError("give sandbox IDs, or --all --metadata KEY=VALUE")
    return ids or []


def rm(
    ctx: typer.Context,
    sandbox_ids: Annotated[
        list[str] | None, typer.Argument(metavar="[ID...]", help="Sandbox IDs.")
    ] = None,
    all_: AllOpt = False,
    metadata: MatchOpt = None,
) -> None:
    """Remove (kill) sandboxes; prints each removed ID.

    Examples:

    ```
    aenv rm i1a2b3c4d5
    aenv ls -s paused -q | xargs aenv rm
    aenv rm --all -m run=r1             # every sandbox with that metadata, in one call
    ```
    """
    ids = _ids_or_all(sandbox_ids, all_, metadata)
    if all_:
        _bulk(ctx, "DELETE", "/sandboxes", metadata)
        return
    failed = False
    with state_of(ctx).control() as cp:
        for sandbox_id in ids:
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
    sandbox_id: Annotated[str | None, typer.Argument(metavar="[ID]", help="Sandbox ID.")] = None,
    all_: AllOpt = False,
    metadata: MatchOpt = None,
) -> None:
    """Pause a running sandbox (memory and filesystem are kept).

    Examples:

    ```
    aenv pause i1a2b3c4d5
    aenv pause --all -m run=r1          # every running sandbox with that metadata
    ```
    """
    ids = _ids_or_all([sandbox_id] if sandbox_id else None, all_, metadata)
    if all_:
        _bulk(ctx, "POST", "/sandboxes/pause", metadata)
        return
    with state_of(ctx).control() as cp:
        cp.pause(ids[0])
    print(ids[0])


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
    args: Annotated[
        list[str], typer.Argument(metavar="ID SECS | SECS", help="Sandbox ID and seconds.")
    ],
    all_: AllOpt = False,
    metadata: MatchOpt = None,
) -> None:
    """Set a sandbox's remaining lifetime (seconds from now).

    Examples:

    ```
    aenv timeout i1a2b3c4d5 3600
    aenv timeout --all -m run=r1 600    # every running sandbox with that metadata
    ```
    """
    # ID then SECS, or SECS alone with --all: one list, as typer has no optional first
    # positional before a required one.
    *ids, secs = args
    if not secs.isdigit():
        raise _click.exceptions.UsageError(f"SECS must be a whole number of seconds, got {secs!r}")
    seconds = int(secs)
    ids = _ids_or_all(ids or None, all_, metadata)
    if all_:
        _bulk(ctx, "POST", "/sandboxes/timeout", metadata, {"timeout": seconds})
        return
    if len(ids) != 1:
        raise _click.exceptions.UsageError("give one sandbox ID and the seconds")
    with state_of(ctx).control() as cp:
        cp.set_timeout(ids[0], seconds)
    print(ids[0])


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
