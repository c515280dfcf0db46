"""`aenv`: the command line for an aenv server (and the server itself: `aenv server`)."""

from __future__ import annotations

import enum
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from typer.core import TyperGroup

from .. import __version__
from ..errors import AenvError
from .bench import register as register_bench
from .client import ControlPlane
from .connect import ConnectError, EnvdClient
from .errors import CliError, one_line
from .templates import register as register_templates

if TYPE_CHECKING:
    from ..config import Settings


class AenvGroup(TyperGroup):
    """Turns expected failures into one `aenv: <message>` line on stderr (no traceback)."""

    def invoke(self, ctx: Any) -> Any:  # typer's (vendored) click.Context
        try:
            return super().invoke(ctx)
        except CliError as exc:
            _fail(exc.message, exc.exit_code)
        except AenvError as exc:  # from in-process work: `server`, `template build-base`
            _fail(exc.message)
        except KeyboardInterrupt:
            raise typer.Exit(130) from None


def _fail(message: str, code: int = 1) -> NoReturn:
    sys.stderr.write(f"aenv: {one_line(message)}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


app = typer.Typer(
    name="aenv",
    cls=AenvGroup,
    help="Run and manage aenv sandboxes (E2B-compatible, on gVisor).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
from .snapshots import fork as fork_command  # noqa: E402
from .snapshots import snapshot_app  # noqa: E402

template_app = typer.Typer(help="Manage templates.", no_args_is_help=True)
app.add_typer(template_app, name="template")
app.add_typer(snapshot_app, name="snapshot")
app.command("fork")(fork_command)
register_bench(app)  # `aenv bench` (cli/bench.py; the harness is in bench/)


# -- global state -------------------------------------------------------------------------


@dataclass
class CliState:
    url_option: str | None = None
    api_key_option: str | None = None
    _settings: Settings | None = field(default=None, repr=False)

    def settings(self) -> Settings:
        if self._settings is None:
            from ..config import load_settings

            try:
                self._settings = load_settings()
            except Exception as exc:  # pydantic ValidationError, a broken config.toml
                raise CliError(f"bad configuration: {exc}") from None
        return self._settings

    @property
    def url(self) -> str:
        if self.url_option:
            return self.url_option.rstrip("/")
        listen = self.settings().listen
        host, _, port = listen.rpartition(":")
        if host in ("", "0.0.0.0", "::", "[::]"):
            host = "127.0.0.1"
        return f"http://{host}:{port}"

    def key_file(self) -> Path:
        return self.settings().secrets_dir / "api-key"

    def api_key(self) -> tuple[str | None, str]:
        """(key or None, a hint for a 401). Never creates a key (the server does)."""
        if self.api_key_option:
            return self.api_key_option, "check --api-key / AENV_API_KEY"
        settings = self.settings()
        if settings.api_key:
            return settings.api_key, "check api_key in the aenv config file"
        path = self.key_file()
        try:
            key = path.read_text().strip()
        except FileNotFoundError:
            return None, f"no API key: set AENV_API_KEY or --api-key ({path} does not exist)"
        except OSError as exc:
            reason = exc.strerror or str(exc)
            return None, f"no API key: set AENV_API_KEY or --api-key (cannot read {path}: {reason})"
        return (key or None), f"the key in {path} was not accepted; set AENV_API_KEY"

    def control(self) -> ControlPlane:
        key, hint = self.api_key()
        return ControlPlane(self.url, key, key_hint=hint)

    def envd(self, sandbox_id: str, token: str | None, user: str | None = None) -> EnvdClient:
        return EnvdClient(self.url, sandbox_id, token, user=user)


def _state(ctx: typer.Context) -> CliState:
    obj = ctx.find_root().obj
    if not isinstance(obj, CliState):
        obj = CliState()
        ctx.find_root().obj = obj
    return obj


def _version(value: bool) -> None:
    if value:
        print(f"aenv {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    url: Annotated[
        str | None,
        typer.Option(
            "--url",
            envvar="AENV_URL",
            help="Server URL (default: http://$AENV_LISTEN, i.e. http://127.0.0.1:8000).",
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="AENV_API_KEY",
            show_default=False,
            help="API key (default: read from $AENV_HOME/secrets/api-key).",
        ),
    ] = None,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Show the version."),
    ] = False,
) -> None:
    ctx.obj = CliState(url_option=url, api_key_option=api_key)


# -- helpers ------------------------------------------------------------------------------


def _pairs(values: list[str] | None, option: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"{option} expects KEY=VALUE, got {item!r}")
        out[key] = value
    return out


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


def _note(message: str) -> None:
    sys.stderr.write(f"aenv: {message}\n")
    sys.stderr.flush()


class OutputFormat(enum.StrEnum):
    table = "table"
    json = "json"


UserOpt = Annotated[
    str | None, typer.Option("--user", "-u", help="Run as this user (default: the sandbox's).")
]
CwdOpt = Annotated[str | None, typer.Option("--cwd", "-w", help="Working directory.")]
EnvOpt = Annotated[
    list[str] | None,
    typer.Option("--env", "-e", metavar="KEY=VALUE", help="Environment variable (repeatable)."),
]
OutputOpt = Annotated[OutputFormat, typer.Option("--output", "-o", help="Output format.")]


def _keepalive_interval(timeout: int) -> float:
    return float(max(5, min(60, timeout // 3)))


# -- server -------------------------------------------------------------------------------


@app.command()
def server(
    ctx: typer.Context,
    listen: Annotated[
        str | None,
        typer.Option(
            "--listen",
            metavar="HOST:PORT",
            help="Listen address (default: $AENV_LISTEN or 127.0.0.1:8000).",
        ),
    ] = None,
) -> None:
    """Run the aenv server (control plane and sandbox proxy on one port)."""
    settings = _state(ctx).settings()
    if listen:
        settings = settings.model_copy(update={"listen": listen})
    from ..server import serve

    serve(settings)


# -- sandboxes ----------------------------------------------------------------------------


@app.command()
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
) -> None:
    """Create a sandbox and open an interactive shell in it (removed when the shell exits)."""
    state = _state(ctx)
    body: dict[str, Any] = {
        "templateID": template,
        "timeout": timeout,
        "metadata": _pairs(metadata, "--metadata"),
        "envVars": _pairs(env, "--env"),
    }
    if cpu is not None:
        body["cpuCount"] = cpu
    if memory is not None:
        body["memoryMB"] = memory
    if auto_pause:
        body["autoPause"] = True
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
                _note(
                    f"sandbox {sandbox_id} ({template}); "
                    + ("it is kept" if keep else "it is removed")
                    + " when the shell exits"
                )
            code = _shell(state, cp, sandbox_id, token, timeout, user, cwd)
        finally:
            if keep:
                _note(
                    f"sandbox {sandbox_id} kept; reconnect with `aenv connect {sandbox_id}`, "
                    f"remove with `aenv rm {sandbox_id}`"
                )
            else:
                try:
                    cp.kill(sandbox_id)
                except CliError as exc:
                    _note(f"could not remove sandbox {sandbox_id}: {exc.message}")
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


@app.command("connect")
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
    state = _state(ctx)
    with state.control() as cp:
        sandbox = cp.connect(sandbox_id, timeout)
        code = _shell(state, cp, sandbox_id, sandbox.get("envdAccessToken"), timeout, user, cwd)
    raise typer.Exit(code)


@app.command("exec")
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

    state = _state(ctx)
    envs = _pairs(env, "--env")
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


@app.command("ls")
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
    from .output import console, print_json, print_table, sandbox_table

    if state_filter:
        states = [s.strip() for s in state_filter.split(",") if s.strip()]
        bad = [s for s in states if s not in _STATES]
        if bad or not states:
            raise CliError(f"--state takes running, paused or both, got {state_filter!r}")
        state_filter = ",".join(states)
    with _state(ctx).control() as cp:
        sandboxes = cp.list_sandboxes(state=state_filter, metadata=_pairs(metadata, "--metadata"))
    if output is OutputFormat.json:
        print_json(sandboxes)
    elif not sandboxes:
        console(stderr=True).print("no sandboxes", style="dim")
    else:
        print_table(sandbox_table(sandboxes))


@app.command("rm")
def rm(
    ctx: typer.Context,
    sandbox_ids: Annotated[list[str], typer.Argument(metavar="ID...", help="Sandbox IDs.")],
) -> None:
    """Remove (kill) sandboxes; prints each removed ID."""
    failed = False
    with _state(ctx).control() as cp:
        for sandbox_id in sandbox_ids:
            try:
                cp.kill(sandbox_id)
            except CliError as exc:
                if exc.status is None:  # the server is unreachable: stop here
                    raise
                failed = True
                msg = exc.message
                _note(msg if sandbox_id in msg else f"{sandbox_id}: {msg}")
                continue
            print(sandbox_id, flush=True)
    if failed:
        raise typer.Exit(1)


@app.command()
def pause(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox ID.")],
) -> None:
    """Pause a running sandbox (memory and filesystem are kept)."""
    with _state(ctx).control() as cp:
        cp.pause(sandbox_id)
    print(sandbox_id)


@app.command()
def resume(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox ID.")],
    timeout: Annotated[
        int | None,
        typer.Option("--timeout", "-t", min=1, help="Seconds to live from now."),
    ] = None,
) -> None:
    """Resume a paused sandbox (a no-op for a running one)."""
    with _state(ctx).control() as cp:
        cp.connect(sandbox_id, timeout)
    print(sandbox_id)


@app.command("timeout")
def timeout_(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox ID.")],
    seconds: Annotated[
        int, typer.Argument(metavar="SECS", min=0, help="Seconds to live from now.")
    ],
) -> None:
    """Set a sandbox's remaining lifetime."""
    with _state(ctx).control() as cp:
        cp.set_timeout(sandbox_id, seconds)
    print(sandbox_id)


@app.command()
def info(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox ID.")],
    output: OutputOpt = OutputFormat.table,
) -> None:
    """Show a sandbox's details."""
    from .output import info_table, print_json, print_table

    with _state(ctx).control() as cp:
        data = cp.get_sandbox(sandbox_id)
    if output is OutputFormat.json:
        print_json(data)
    else:
        print_table(info_table(data))


# -- templates ----------------------------------------------------------------------------


@template_app.command("ls")
def template_ls(ctx: typer.Context, output: OutputOpt = OutputFormat.table) -> None:
    """List templates."""
    from .output import console, print_json, print_table, template_table

    with _state(ctx).control() as cp:
        templates = cp.list_templates()
    if output is OutputFormat.json:
        print_json(templates)
    elif not templates:
        console(stderr=True).print("no templates", style="dim")
    else:
        print_table(template_table(templates))


@template_app.command("build-base")
def template_build_base(
    ctx: typer.Context,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Rebuild even if template base is up to date.")
    ] = False,
) -> None:
    """Build the default template `base` (Debian, debootstrap) on this machine."""
    from ..builds.base import build_base

    settings = _state(ctx).settings()
    if quiet:
        build_base(settings, force=force)
        return
    with _BuildProgress() as progress:
        layers = build_base(settings, force=force, progress=progress)
    print(f"template base: {', '.join(layers)}")


class _BuildProgress:
    """Renders `progress(stage, detail)` callbacks: a spinner with the latest line on a
    terminal, one line per stage otherwise; each finished stage is printed with its time."""

    def __init__(self) -> None:
        from .output import console

        self.console = console(stderr=True)
        self.live = self.console.is_terminal
        self.stage: str | None = None
        self.t_stage = time.monotonic()
        self._status: Any = None

    def __enter__(self) -> _BuildProgress:
        if self.live:
            self._status = self.console.status("starting", spinner="dots")
            self._status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.stop()
        if exc[0] is None:
            self._finish_stage()

    def _finish_stage(self) -> None:
        if self.stage and self.stage != "done":
            took = time.monotonic() - self.t_stage
            self.console.print(f"[green]✓[/] {self.stage} [dim]({took:.1f}s)[/]", highlight=False)

    def __call__(self, stage: str, detail: str) -> None:
        from rich.markup import escape

        if stage != self.stage:
            self._finish_stage()
            self.stage = stage
            self.t_stage = time.monotonic()
            if not self.live or stage == "done":
                self.console.print(f"{escape(stage)}: {escape(detail)}", highlight=False)
        if self._status is not None:
            self._status.update(f"[bold]{escape(stage)}[/] {escape(one_line(detail))[:200]}")


if __name__ == "__main__":  # pragma: no cover
    app()


register_templates(app, template_app, _state)  # `aenv pull`, `aenv build`, `aenv template rm`
