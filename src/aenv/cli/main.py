"""`aenv`: the command line for an aenv server (and the server itself: `aenv server`).

This module is the command table: the root app, its global options and every command, each
defined in the module of its job (`sandboxes`, `templates`, `snapshots`, `bench`), registered
here in the order `aenv --help` lists them.
"""

from __future__ import annotations

import errno
import os
import sys
import traceback
from typing import Annotated, Any, NoReturn

import typer
from typer import _click
from typer.core import TyperGroup

from .. import DISTRIBUTION, __version__
from ..config import Settings
from ..errors import AenvError
from . import (
    auth,
    contexts,
    copy,
    execute,
    forktree,
    keys,
    lineage,
    nodes,
    observe,
    sandboxes,
    snapshots,
    tags,
    templates,
    volumes,
)
from .bench import bench
from .errors import EXIT_AENV, EXIT_FAILURE, CliError, missing_server_extra, one_line
from .global_flags import spread_global_flags
from .state import CliState, state_of

# The commands whose exit code is a sandboxed command's: their own failures exit 125
# (usage mistakes included), never a code the command could have returned (errors.py).
PASSES_EXIT_CODE = frozenset({"exec", "start", "connect"})


class AenvGroup(TyperGroup):
    """Turns every failure into one `aenv: <message>` line on stderr and a non-zero exit
    code: expected ones (CliError, AenvError), usage errors (exit code 2), local I/O errors
    and, as a last resort, unexpected exceptions; 125 for all of them in the commands of
    PASSES_EXIT_CODE. `--debug` (or AENV_DEBUG=1) adds the traceback."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # typer builds the subcommands first: they are all here to take the root's flags.
        spread_global_flags(self)

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().make_context(*args, **kwargs)
        except _click.exceptions.UsageError as exc:
            _usage_fail(exc)

    def invoke(self, ctx: Any) -> Any:  # typer's (vendored) click.Context
        try:
            return super().invoke(ctx)
        except BaseException:
            # Which command failed: the group sets it before parsing the command's options,
            # so a usage error of `exec` knows it too.
            passes = ctx.invoked_subcommand in PASSES_EXIT_CODE
            self._fail_with(ctx, EXIT_AENV if passes else EXIT_FAILURE, passes)

    def _fail_with(self, ctx: Any, failed: int, passes: bool) -> NoReturn:
        """The exception being handled as one line and its exit code."""
        try:
            raise
        except CliError as exc:
            _fail(exc.message, exc.exit_code_in(passes), ctx)
        except AenvError as exc:  # from in-process work: `server`, `template build-base`
            _fail(exc.message, failed, ctx)
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        except _click.exceptions.UsageError as exc:
            _usage_fail(exc, EXIT_AENV if passes else None)
        except (_click.exceptions.ClickException, typer.Exit, typer.Abort):
            raise
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                raise  # typer's main exits quietly on a closed pipe (`aenv ls | head`)
            where = f"{exc.filename}: " if exc.filename else ""
            _fail(f"{where}{exc.strerror or exc}", failed, ctx)
        except ModuleNotFoundError as exc:  # a server package, in a client-only install
            _fail(missing_server_extra(exc, DISTRIBUTION) or _internal(exc), failed, ctx)
        except Exception as exc:  # a bug: still one line, the traceback with --debug
            _fail(_internal(exc), failed, ctx)


def _internal(exc: BaseException) -> str:
    return f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)"


def _debug(ctx: Any) -> bool:
    obj = ctx.find_root().obj if ctx is not None else None
    if isinstance(obj, CliState) and obj.debug:
        return True
    return os.environ.get("AENV_DEBUG", "").lower() in ("1", "true", "yes")


def _fail(message: str, code: int = EXIT_FAILURE, ctx: Any = None) -> NoReturn:
    if _debug(ctx):
        traceback.print_exc()
    sys.stderr.write(f"aenv: {one_line(message)}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


def _usage_fail(exc: Any, code: int | None = None) -> NoReturn:
    """A usage error as one line naming the command's --help (exit code 2, as click's;
    `code` when given)."""
    if isinstance(exc, _click.exceptions.NoArgsIsHelpError):
        raise exc  # `aenv template` alone: the help, as asked for
    path = exc.ctx.command_path if exc.ctx is not None else "aenv"
    sys.stderr.write(f"aenv: {one_line(exc.format_message())} (see `{path} --help`)\n")
    sys.stderr.flush()
    raise typer.Exit(exc.exit_code if code is None else code)


app = typer.Typer(
    name="aenv",
    cls=AenvGroup,
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_show_locals=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)
template_app = typer.Typer(help="Manage templates.", no_args_is_help=True)
snapshot_app = typer.Typer(
    help="Snapshots: templates made from running sandboxes.", no_args_is_help=True
)
volume_app = typer.Typer(
    help="Volumes: named directories sandboxes mount (E2B's Volume).", no_args_is_help=True
)
node_app = typer.Typer(help="Nodes of a cluster (through a gateway).", no_args_is_help=True)
tags_app = typer.Typer(
    help="A template's tags: names of its builds (E2B's template tags).", no_args_is_help=True
)
context_app = typer.Typer(
    help="Contexts: saved servers and their keys; one is current (`--context` picks "
    "another for one call).",
    no_args_is_help=True,
)
keys_app = typer.Typer(
    help="API keys of this node (run on the node host; no server needed).", no_args_is_help=True
)


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
            help=(
                "Server URL (else AENV_URL, E2B_API_URL, https://api.$E2B_DOMAIN, the "
                "context, then http://$AENV_LISTEN; https when AENV_TLS_CERT is set; "
                "AENV_TLS_VERIFY=false|CA-FILE for its certificate). Anywhere on the line."
            ),
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            show_default=False,
            help="API key (else AENV_API_KEY, E2B_API_KEY, the context's, then "
            "$AENV_HOME/secrets/api-key). Anywhere on the line.",
        ),
    ] = None,
    context: Annotated[
        str | None,
        typer.Option(
            "--context",
            metavar="NAME",
            show_default=False,
            help="Use this saved context (server and key) for this call (else "
            "AENV_CONTEXT, else the current one: `aenv context`).",
        ),
    ] = None,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Show the version."),
    ] = False,
    debug: Annotated[
        bool,
        typer.Option("--debug", envvar="AENV_DEBUG", help="Show the traceback of an error, too."),
    ] = False,
) -> None:
    """Run and manage aenv sandboxes (E2B-compatible, on gVisor).

    Quick start:

    ```
    aenv auth                        # store a server URL and API key
    aenv status                      # server, version, capacity
    aenv start                       # a shell in a new `base` sandbox
    aenv start -d --cpu 2            # in the background: prints the ID
    aenv exec ID -- python3 -V       # run a command in it
    aenv cp ./src ID:/home/user/     # copy a tree in (swap: out)
    aenv ls                          # sandboxes (JSON when piped)
    aenv rm ID
    ```

    Every command has examples in its --help. Errors are one `aenv: ...` line on stderr
    with a non-zero exit code (--debug adds the traceback).
    """
    ctx.obj = CliState(url_option=url, api_key_option=api_key, debug=debug, context_option=context)


ListenOption = Annotated[
    str | None,
    typer.Option(
        "--listen",
        metavar="HOST:PORT",
        help="Listen address (default: $AENV_LISTEN or 127.0.0.1:8000).",
    ),
]


def _served_settings(ctx: typer.Context, listen: str | None) -> Settings:
    settings = state_of(ctx).settings()
    return settings.model_copy(update={"listen": listen}) if listen else settings


def server(ctx: typer.Context, listen: ListenOption = None) -> None:
    """Run the aenv server (control plane and sandbox proxy on one port).

    Examples:

    ```
    sudo aenv server
    sudo aenv server --listen 0.0.0.0:8000
    ```
    """
    from ..server import serve

    serve(_served_settings(ctx, listen))


def gateway(ctx: typer.Context, listen: ListenOption = None) -> None:
    """Run a gateway: the same API in front of the nodes of a cluster (needs AENV_REDIS_URL).

    Examples:

    ```
    AENV_REDIS_URL=redis://10.0.0.2:6379 aenv gateway --listen 0.0.0.0:8080
    ```
    """
    from ..server import serve_gateway

    serve_gateway(_served_settings(ctx, listen))


# The command table, in the order `aenv --help` lists it, grouped into panels.
SANDBOXES, FILES, IMAGES, SETUP = "Sandboxes", "Files and observability", "Templates", "Setup"

app.command("auth", rich_help_panel=SETUP)(auth.auth)
app.command("status", rich_help_panel=SETUP)(auth.status)
app.command("start", rich_help_panel=SANDBOXES)(sandboxes.start)
app.command("connect", rich_help_panel=SANDBOXES)(sandboxes.connect_)
app.command("exec", rich_help_panel=SANDBOXES)(execute.exec_)
app.command("ls", rich_help_panel=SANDBOXES)(sandboxes.ls)
app.command("inspect", rich_help_panel=SANDBOXES)(sandboxes.inspect)
app.command("info", hidden=True)(sandboxes.inspect)  # the old name of `inspect`
app.command("rm", rich_help_panel=SANDBOXES)(sandboxes.rm)
app.command("pause", rich_help_panel=SANDBOXES)(sandboxes.pause)
app.command("resume", rich_help_panel=SANDBOXES)(sandboxes.resume)
app.command("timeout", rich_help_panel=SANDBOXES)(sandboxes.timeout_)
app.command("fork", rich_help_panel=SANDBOXES)(snapshots.fork)
app.command("tree", rich_help_panel=SANDBOXES)(lineage.tree)
app.command("diff", rich_help_panel=SANDBOXES)(forktree.diff)
app.command("apply", rich_help_panel=SANDBOXES)(forktree.apply)
app.command("rollback", rich_help_panel=SANDBOXES)(forktree.rollback)
app.command("cp", rich_help_panel=FILES)(copy.cp)
app.command("logs", rich_help_panel=FILES)(observe.logs)
app.command("top", rich_help_panel=FILES)(observe.top)
app.command("pull", rich_help_panel=IMAGES)(templates.pull)
app.command("build", rich_help_panel=IMAGES)(templates.build)
app.command("server", rich_help_panel=SETUP)(server)
app.command("gateway", rich_help_panel=SETUP)(gateway)
app.command("bench", rich_help_panel=SETUP)(bench)

app.add_typer(snapshot_app, name="snapshot", rich_help_panel=SANDBOXES)
snapshot_app.command("create")(snapshots.snapshot_create)
snapshot_app.command("ls")(snapshots.snapshot_ls)
snapshot_app.command("rm")(snapshots.snapshot_rm)

app.add_typer(volume_app, name="volume", rich_help_panel=FILES)
volume_app.command("create")(volumes.volume_create)
volume_app.command("ls")(volumes.volume_ls)
volume_app.command("rm")(volumes.volume_rm)
volume_app.command("files")(volumes.volume_files)
volume_app.command("cp")(volumes.volume_cp)

app.add_typer(template_app, name="template", rich_help_panel=IMAGES)
template_app.command("ls")(templates.template_ls)
template_app.command("rm")(templates.template_rm)
template_app.command("set")(templates.template_set)
template_app.add_typer(tags_app, name="tags")
tags_app.command("ls")(tags.tags_ls)
tags_app.command("add")(tags.tags_add)
tags_app.command("rm")(tags.tags_rm)
template_app.command("build-base")(templates.template_build_base)
template_app.command("build-code-interpreter")(templates.template_build_code_interpreter)

app.add_typer(node_app, name="node", rich_help_panel=SETUP)
node_app.command("ls")(nodes.node_ls)
node_app.command("drain")(nodes.node_drain)
node_app.command("undrain")(nodes.node_undrain)

app.add_typer(context_app, name="context", rich_help_panel=SETUP)
context_app.command("ls")(contexts.context_ls)
context_app.command("use")(contexts.context_use)
context_app.command("add")(contexts.context_add)
context_app.command("rm")(contexts.context_rm)
context_app.command("show")(contexts.context_show)

app.add_typer(keys_app, name="keys", rich_help_panel=SETUP)
keys_app.command("create")(keys.keys_create)
keys_app.command("set")(keys.keys_set)
keys_app.command("ls")(keys.keys_ls)
keys_app.command("rm")(keys.keys_rm)


if __name__ == "__main__":  # pragma: no cover
    app()
