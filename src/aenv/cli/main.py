"""`aenv`: the command line for an aenv server (and the server itself: `aenv server`).

This module is the command table: the root app, its global options and every command, each
defined in the module of its job (`sandboxes`, `templates`, `snapshots`, `bench`), registered
here in the order `aenv --help` lists them.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, NoReturn

import typer
from typer.core import TyperGroup

from .. import __version__
from ..config import Settings
from ..errors import AenvError
from . import keys, nodes, sandboxes, snapshots, templates, volumes
from .bench import bench
from .errors import CliError, one_line
from .state import CliState, state_of


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
template_app = typer.Typer(help="Manage templates.", no_args_is_help=True)
snapshot_app = typer.Typer(
    help="Snapshots: templates made from running sandboxes.", no_args_is_help=True
)
volume_app = typer.Typer(
    help="Volumes: named directories sandboxes mount (E2B's Volume).", no_args_is_help=True
)
node_app = typer.Typer(help="Nodes of a cluster (through a gateway).", no_args_is_help=True)
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
            envvar="AENV_URL",
            help=(
                "Server URL (default: http://$AENV_LISTEN, i.e. http://127.0.0.1:8000; https "
                "when AENV_TLS_CERT is set; AENV_TLS_VERIFY=false|CA-FILE for its certificate)."
            ),
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
    """Run the aenv server (control plane and sandbox proxy on one port)."""
    from ..server import serve

    serve(_served_settings(ctx, listen))


def gateway(ctx: typer.Context, listen: ListenOption = None) -> None:
    """Run a gateway: the same API in front of the nodes of a cluster (needs AENV_REDIS_URL)."""
    from ..cluster.serve import serve_gateway

    serve_gateway(_served_settings(ctx, listen))


app.command("fork")(snapshots.fork)
app.command("bench")(bench)
app.command("server")(server)
app.command("gateway")(gateway)
app.command("start")(sandboxes.start)
app.command("connect")(sandboxes.connect_)
app.command("exec")(sandboxes.exec_)
app.command("ls")(sandboxes.ls)
app.command("rm")(sandboxes.rm)
app.command("pause")(sandboxes.pause)
app.command("resume")(sandboxes.resume)
app.command("timeout")(sandboxes.timeout_)
app.command("info")(sandboxes.info)
app.command("pull")(templates.pull)
app.command("build")(templates.build)

app.add_typer(template_app, name="template")
template_app.command("ls")(templates.template_ls)
template_app.command("build-base")(templates.template_build_base)
template_app.command("build-code-interpreter")(templates.template_build_code_interpreter)
template_app.command("rm")(templates.template_rm)

app.add_typer(snapshot_app, name="snapshot")
snapshot_app.command("create")(snapshots.snapshot_create)
snapshot_app.command("ls")(snapshots.snapshot_ls)

app.add_typer(volume_app, name="volume")
volume_app.command("create")(volumes.volume_create)
volume_app.command("ls")(volumes.volume_ls)
volume_app.command("rm")(volumes.volume_rm)
volume_app.command("files")(volumes.volume_files)
volume_app.command("cp")(volumes.volume_cp)

app.add_typer(node_app, name="node")
node_app.command("ls")(nodes.node_ls)
node_app.command("drain")(nodes.node_drain)
node_app.command("undrain")(nodes.node_undrain)

app.add_typer(keys_app, name="keys")
keys_app.command("create")(keys.keys_create)
keys_app.command("ls")(keys.keys_ls)
keys_app.command("rm")(keys.keys_rm)


if __name__ == "__main__":  # pragma: no cover
    app()
