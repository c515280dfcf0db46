"""The template commands: `aenv pull`, `aenv build`, `aenv template ls|build-base|rm`.

Both pull and build work against a remote server: `pull` asks the server to pull
(`POST /images/pull`, progress streamed back as NDJSON) and, with `--name`, runs a build
without steps; `build` parses the Dockerfile here and runs the build through `builds.py`.
`template build-base` is the one that works in-process, on this machine.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from .builds import context_files, read_dockerignore, run_build
from .client import ControlPlane, url_segment
from .errors import CliError, one_line
from .options import ListOutputOpt, QuietOpt, WatchOpt, pairs
from .state import state_of


def stream_json(cp: ControlPlane, method: str, path: str, body: Any) -> Iterator[dict[str, Any]]:
    """The lines of an NDJSON answer, parsed."""
    with cp.stream(method, path, json=body) as resp:
        for line in resp.iter_lines():
            if line.strip():
                obj = json.loads(line)
                if isinstance(obj, dict):
                    yield obj


# -- progress -------------------------------------------------------------------------------


class PullProgress:
    """One rich progress bar per layer (stderr); plain lines without a terminal."""

    def __init__(self) -> None:
        from .output import console

        self.console = console(stderr=True)
        self.live = self.console.is_terminal
        self.tasks: dict[str, Any] = {}
        self.progress: Any = None
        if self.live:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TransferSpeedColumn,
            )

            self.progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TextColumn("{task.fields[status]}"),
                console=self.console,
            )

    def __enter__(self) -> PullProgress:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def layer(self, ev: dict[str, Any]) -> None:
        digest = str(ev.get("digest") or "")
        short = digest.partition(":")[2][:12] or digest
        done, total = int(ev.get("done") or 0), int(ev.get("total") or 0)
        status = str(ev.get("status") or "")
        if self.progress is not None:
            task = self.tasks.get(digest)
            if task is None:
                task = self.tasks[digest] = self.progress.add_task(
                    short, total=total or None, status=status
                )
            self.progress.update(task, completed=done, status=status)
        elif status in ("done", "present") and digest not in self.tasks:
            self.tasks[digest] = True
            what = "already present" if status == "present" else f"pulled ({total / 1e6:.1f} MB)"
            self.console.print(f"{short}: {what}", highlight=False)


def pull_image(
    cp: ControlPlane, image: str, registry: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Pull `image` on the server with a progress bar per layer (stderr); the pulled image's
    record (`reference`, `digest`, `size`), also summed up on stderr."""
    body: dict[str, Any] = {"image": image}
    if registry:
        body["registry"] = registry
    pulled: dict[str, Any] | None = None
    with PullProgress() as progress:
        for ev in stream_json(cp, "POST", "/images/pull", body):
            kind = ev.get("type")
            if kind == "layer":
                progress.layer(ev)
            elif kind == "error":
                raise CliError(str(ev.get("message") or "pull failed"))
            elif kind == "done":
                pulled = ev.get("image") or {}
    if pulled is None:
        raise CliError("the pull ended without a result")
    ref = str(pulled.get("reference") or image)
    digest = str(pulled.get("digest") or "")
    size = int(pulled.get("size") or 0)
    sys.stderr.write(f"pulled {ref}@{digest} ({size / 1e6:.1f} MB)\n")
    sys.stderr.flush()
    return pulled


# -- commands -------------------------------------------------------------------------------


def template_ls(
    ctx: typer.Context,
    output: ListOutputOpt = None,
    quiet: QuietOpt = False,
    watch: WatchOpt = False,
) -> None:
    """List templates (`-w`: follow their build status until Ctrl-C).

    Examples:

    ```
    aenv template ls
    aenv template ls -o wide
    aenv template ls -q
    aenv template ls -w          # watch a build go from building to ready
    ```
    """
    from .output import TEMPLATES, resolve_format
    from .watch import show_listing

    with state_of(ctx).control() as cp:
        show_listing(cp.list_templates, TEMPLATES, resolve_format(output), quiet, watch)


def template_build_base(
    ctx: typer.Context,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Rebuild even if template base is up to date.")
    ] = False,
) -> None:
    """Build the default template `base` (Debian, debootstrap) on this machine.

    Examples:

    ```
    sudo aenv template build-base
    sudo aenv template build-base --force -q
    ```
    """
    from ..builds.base import build_base

    settings = state_of(ctx).settings()
    if quiet:
        build_base(settings, force=force)
        return
    with _BuildProgress() as progress:
        layers = build_base(settings, force=force, progress=progress)
    print(f"template base: {', '.join(layers)}")


def template_build_code_interpreter(
    ctx: typer.Context,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
) -> None:
    """Build template `code-interpreter-v1` (for the e2b-code-interpreter SDK).

    Its files are made on this machine (like build-base), then its start command runs on
    the server.

    Examples:

    ```
    sudo aenv template build-code-interpreter
    ```
    """
    from ..builds import code_interpreter as ci
    from .builds import LogPrinter, follow_build, request_build, start_build

    st = state_of(ctx)
    settings = st.settings()
    if quiet:
        stamp = ci.ensure_rootfs(settings)
    else:
        with _BuildProgress() as progress:
            stamp = ci.ensure_rootfs(settings, progress=progress)
    if ci.is_current(settings, stamp):
        if not quiet:
            print(f"template {ci.TEMPLATE_NAME} is up to date")
        return
    with st.control() as cp:
        req = request_build(cp, ci.TEMPLATE_NAME, cpu=None, memory=ci.MEMORY_MB)
        tid, bid = str(req["templateID"]), str(req["buildID"])
        start_build(cp, tid, bid, ci.build_spec(stamp))
        final = follow_build(cp, tid, bid, (lambda _e: None) if quiet else LogPrinter())
    if final.get("status") != "ready":
        reason = final.get("reason") or {}
        raise CliError(f"build failed: {reason.get('message') or final.get('status')}")
    if not quiet:
        print(f"template {ci.TEMPLATE_NAME}: {tid}")


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


def pull(
    ctx: typer.Context,
    image: Annotated[str, typer.Argument(help="Image reference, e.g. python:3.12-slim.")],
    name: Annotated[
        str | None, typer.Option("--name", "-n", help="Also make it a template of this name.")
    ] = None,
    start_cmd: Annotated[
        str | None, typer.Option("--start-cmd", help="Start command (template snapshot).")
    ] = None,
    ready_cmd: Annotated[
        str | None, typer.Option("--ready-cmd", help="Ready check for the start command.")
    ] = None,
    cpu: Annotated[int | None, typer.Option("--cpu", min=1, help="vCPUs.")] = None,
    memory: Annotated[int | None, typer.Option("--memory", min=128, help="MB.")] = None,
    username: Annotated[
        str | None, typer.Option("--username", help="Registry user (with --password).")
    ] = None,
    password: Annotated[
        str | None, typer.Option("--password", envvar="AENV_REGISTRY_PASSWORD")
    ] = None,
) -> None:
    """Pull an image on the server (progress per layer); with --name, make it a template.

    Examples:

    ```
    aenv pull python:3.12-slim
    aenv pull python:3.12-slim --name py312 --cpu 2 --memory 1024
    aenv pull ghcr.io/me/app:1 --username me --password "$TOKEN" --name app \\
        --start-cmd 'python -m app' --ready-cmd 'curl -sf localhost:8080'
    ```
    """
    if (start_cmd or ready_cmd) and not name:
        raise CliError("--start-cmd and --ready-cmd need --name")
    state = state_of(ctx)
    registry = None
    if username or password:
        if not (username and password):
            raise CliError("--username and --password go together")
        registry = {"type": "registry", "username": username, "password": password}
    with state.control() as cp:
        pulled = pull_image(cp, image, registry)
        ref = str(pulled.get("reference") or image)
        digest = str(pulled.get("digest") or "")
        if not name:
            return
        spec: dict[str, Any] = {
            "fromImage": f"{ref.partition('@')[0]}@{digest}" if digest else ref,
            "steps": [],
            "force": False,
        }
        if registry:
            spec["fromImageRegistry"] = registry
        if start_cmd:
            spec["startCmd"] = start_cmd
        if ready_cmd:
            spec["readyCmd"] = ready_cmd
        done = run_build(cp, name, spec, cpu=cpu, memory=memory)
    print(done["templateID"])


def build(
    ctx: typer.Context,
    path: Annotated[
        Path, typer.Argument(help="A Dockerfile, or the context directory holding one.")
    ],
    name: Annotated[str, typer.Option("--name", "-n", help="Template name.")],
    file: Annotated[
        Path | None, typer.Option("--file", "-f", help="Dockerfile (default: PATH/Dockerfile).")
    ] = None,
    build_arg: Annotated[
        list[str] | None,
        typer.Option("--build-arg", metavar="KEY=VALUE", help="ARG value (repeatable)."),
    ] = None,
    start: Annotated[
        bool,
        typer.Option(
            "--start",
            help="Run ENTRYPOINT/CMD as the start command (snapshot with the process).",
        ),
    ] = False,
    ready_cmd: Annotated[
        str | None, typer.Option("--ready-cmd", help="Ready check for the start command.")
    ] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Ignore the step cache.")] = False,
    cpu: Annotated[int | None, typer.Option("--cpu", min=1, help="vCPUs.")] = None,
    memory: Annotated[int | None, typer.Option("--memory", min=128, help="MB.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug log lines.")] = False,
) -> None:
    """Build a template from a Dockerfile (on the server, with the E2B build API).

    Examples:

    ```
    aenv build . --name my-app
    aenv build ./docker/Dockerfile --name my-app --build-arg PY=3.12 --start
    aenv build ctx/ -f ctx/Dockerfile.dev --name dev --no-cache
    ```
    """
    from ..builds.dockerfile import parse_dockerfile

    if path.is_dir():
        context, dockerfile = path, file or path / "Dockerfile"
    else:
        context, dockerfile = path.parent, file or path
    if not dockerfile.is_file():
        raise CliError(f"no Dockerfile at {dockerfile}")
    try:
        df = parse_dockerfile(dockerfile.read_text(), pairs(build_arg, "--build-arg"))
    except CliError:
        raise
    except Exception as exc:  # DockerfileError (an AenvError) and decoding errors
        raise CliError(f"{dockerfile}: {getattr(exc, 'message', exc)}") from None
    for w in df.warnings:
        sys.stderr.write(f"aenv: warning: {w}\n")
    ignore = read_dockerignore(context)
    uploads = [(c.index, c.src, c.dest, context_files(context, c.src, ignore)) for c in df.copies]
    metadata: dict[str, Any] = dict(df.metadata)
    if df.entrypoint is not None:
        metadata["entrypoint"] = df.entrypoint
    if df.cmd is not None:
        metadata["cmd"] = df.cmd
    spec: dict[str, Any] = {
        "fromImage": df.from_image,
        "steps": df.steps,
        "force": no_cache,
    }
    if metadata:
        spec["metadata"] = metadata
    if start:
        cmd = df.start_cmd()
        if not cmd:
            raise CliError("--start: the Dockerfile has no ENTRYPOINT or CMD")
        spec["startCmd"] = cmd
    if ready_cmd:
        spec["readyCmd"] = ready_cmd
    with state_of(ctx).control() as cp:
        done = run_build(
            cp,
            name,
            spec,
            cpu=cpu,
            memory=memory,
            uploads=uploads,
            context=context,
            verbose=verbose,
        )
    print(done["templateID"])


def template_set(
    ctx: typer.Context,
    template: Annotated[str, typer.Argument(metavar="ID|NAME", help="The template.")],
    standby_after: Annotated[
        str,
        typer.Option(
            "--standby-after",
            metavar="SECONDS|node",
            help="Seconds idle before its sandboxes go to standby (0: never; node: the "
            "node's AENV_STANDBY_AFTER). A create's own standbyAfter wins.",
        ),
    ],
) -> None:
    """Change a template's lifecycle settings; prints them.

    Examples:

    ```
    aenv template set my-app --standby-after 30
    aenv template set my-app --standby-after node
    ```
    """
    seconds: float | None = None
    if standby_after != "node":
        try:
            seconds = float(standby_after)
        except ValueError:
            seconds = -1.0
        if seconds < 0:
            raise CliError(f"--standby-after: {standby_after!r} is not seconds (>= 0) or 'node'")
    with state_of(ctx).control() as cp:
        done = cp.request(
            "PATCH", f"/templates/{url_segment(template)}", json={"standbyAfter": seconds}
        ).json()
    shown = "node" if done.get("standbyAfter") is None else f"{done['standbyAfter']:g}"
    print(f"{done['templateID']}\tstandby-after={shown}")


def template_rm(
    ctx: typer.Context,
    templates: Annotated[
        list[str], typer.Argument(metavar="ID|NAME...", help="Templates to delete.")
    ],
) -> None:
    """Delete templates (and cancel their builds); prints each one removed.

    Examples:

    ```
    aenv template rm my-app
    aenv template rm my-app old-app
    ```
    """
    delete_templates(ctx, templates)


def delete_templates(ctx: typer.Context, templates: list[str]) -> None:
    """`DELETE /templates/{id}` for each; prints each one removed, reports the others."""
    failed = False
    with state_of(ctx).control() as cp:
        for t in templates:
            try:
                cp.request("DELETE", f"/templates/{url_segment(t)}", ok=(204, 200))
            except CliError as exc:
                if exc.status is None:
                    raise
                failed = True
                sys.stderr.write(f"aenv: {t}: {exc.message}\n")
                continue
            print(t, flush=True)
    if failed:
        raise typer.Exit(1)
