"""`aenv pull`, `aenv build` and `aenv template rm`: images and templates over the server's API.

Both pull and build work against a remote server: `pull` asks the server to pull
(`POST /images/pull`, progress streamed back as NDJSON) and, with `--name`, runs a build
without steps; `build` parses the Dockerfile here, uploads the COPY sources like the E2B SDK
(tar.gz per source, named by a content hash, PUT to the URL the server hands out) and drives
the E2B build API (`POST /v3/templates`, `POST /v2/templates/{id}/builds/{bid}`), following
the build's log through `GET .../status?logsOffset=`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import stat
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any
from urllib.parse import quote

import httpx
import typer

from .client import ControlPlane, transport_error
from .errors import CliError

if TYPE_CHECKING:
    from .main import CliState


def _seg(value: str) -> str:
    return quote(value, safe="")


# -- API calls ----------------------------------------------------------------------------


def request_build(
    cp: ControlPlane, name: str, *, cpu: int | None, memory: int | None
) -> dict[str, Any]:
    body: dict[str, Any] = {"name": name}
    if cpu:
        body["cpuCount"] = cpu
    if memory:
        body["memoryMB"] = memory
    data = cp.request("POST", "/v3/templates", json=body, ok=(202,)).json()
    if not isinstance(data, dict) or "templateID" not in data or "buildID" not in data:
        raise CliError("the server's build answer has no templateID/buildID")
    return data


def start_build(cp: ControlPlane, template_id: str, build_id: str, spec: dict[str, Any]) -> None:
    cp.request(
        "POST", f"/v2/templates/{_seg(template_id)}/builds/{_seg(build_id)}", json=spec, ok=(202,)
    )


def follow_build(
    cp: ControlPlane,
    template_id: str,
    build_id: str,
    emit: Callable[[dict[str, Any]], None],
    *,
    interval: float = 0.3,
) -> dict[str, Any]:
    """Polls the build's status until it ends and all its log entries were seen."""
    offset = 0
    path = f"/templates/{_seg(template_id)}/builds/{_seg(build_id)}/status"
    while True:
        data = cp.request("GET", path, params={"logsOffset": str(offset)}).json()
        entries = data.get("logEntries") or []
        for e in entries:
            emit(e)
        offset += len(entries)
        if data.get("status") in ("ready", "error") and not entries:
            return dict(data)
        if not entries:
            time.sleep(interval)


def stream_json(cp: ControlPlane, method: str, path: str, body: Any) -> Iterator[dict[str, Any]]:
    """The lines of an NDJSON answer, parsed."""
    import json

    with cp.stream(method, path, json=body) as resp:
        for line in resp.iter_lines():
            if line.strip():
                obj = json.loads(line)
                if isinstance(obj, dict):
                    yield obj


# -- build contexts -----------------------------------------------------------------------


def read_dockerignore(context: Path) -> list[str]:
    path = context / ".dockerignore"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _ignored(rel: str, patterns: list[str]) -> bool:
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        p = pat[1:] if negate else pat
        p = p.strip("/")
        p = p[2:] if p.startswith("./") else p
        regex = fnmatch.translate(p).replace(".*", "[^/]*").replace("[^/]*[^/]*", ".*")
        if re.match(regex, rel) or any(
            re.match(regex, "/".join(rel.split("/")[:i])) for i in range(1, rel.count("/") + 1)
        ):
            ignored = not negate
    return ignored


def context_files(context: Path, src: str, ignore: list[str]) -> list[Path]:
    """The paths a COPY source names (dirs recursively), sorted, minus .dockerignore."""
    import glob as globmod

    base = context.resolve()
    if globmod.has_magic(src):
        roots = [Path(p) for p in sorted(globmod.glob(str(base / src)))]
    else:
        roots = [base / src] if os.path.lexists(base / src) else []
    if not roots:
        raise CliError(f"COPY source {src!r} not found in {context}")
    out: list[Path] = []
    for root in roots:
        if not str(root.resolve() if not root.is_symlink() else root).startswith(str(base)):
            raise CliError(f"COPY source {src!r} is outside the context {context}")
        todo = [root]
        while todo:
            p = todo.pop()
            rel = os.path.relpath(p, base)
            if rel != "." and _ignored(rel, ignore):
                continue
            if rel != ".":
                out.append(p)
            if p.is_dir() and not p.is_symlink():
                todo.extend(sorted(p.iterdir(), reverse=True))
    return sorted(set(out))


def files_hash(src: str, dest: str, context: Path, files: list[Path]) -> str:
    """Content hash of a COPY source (paths, modes, sizes, contents, link targets)."""
    h = hashlib.sha256(f"COPY {src} {dest}".encode())
    for p in files:
        st = p.lstat()
        h.update(os.path.relpath(p, context.resolve()).encode())
        h.update(str(st.st_mode).encode())
        if stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(p).encode())
        elif stat.S_ISREG(st.st_mode):
            h.update(str(st.st_size).encode())
            with p.open("rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    return h.hexdigest()


def tar_files(context: Path, files: list[Path]) -> IO[bytes]:
    """A gzipped tar of `files` named relative to the context, in a temporary file."""
    out = tempfile.TemporaryFile()  # noqa: SIM115 (returned open)
    base = context.resolve()
    with tarfile.open(fileobj=out, mode="w:gz", format=tarfile.PAX_FORMAT) as tf:
        for p in files:
            tf.add(str(p), arcname=os.path.relpath(p, base), recursive=False)
    out.seek(0)
    return out


def upload_files(cp: ControlPlane, template_id: str, digest: str, archive: IO[bytes]) -> bool:
    """Uploads an archive unless the server has it; True if it was sent."""
    info = cp.request(
        "GET", f"/templates/{_seg(template_id)}/files/{_seg(digest)}", ok=(201, 200)
    ).json()
    if info.get("present") or not info.get("url"):
        return False
    size = os.fstat(archive.fileno()).st_size
    try:
        resp = httpx.put(
            str(info["url"]),
            content=_chunks(archive),
            headers={**(info.get("headers") or {}), "Content-Length": str(size)},
            timeout=httpx.Timeout(60.0, write=3600.0),
        )
    except httpx.TransportError as exc:
        raise transport_error(cp.url, exc) from None
    if resp.status_code >= 300:
        from .client import server_message

        raise CliError(f"uploading build files failed: {server_message(resp)}")
    return True


def _chunks(f: IO[bytes]) -> Iterator[bytes]:
    while chunk := f.read(1 << 20):
        yield chunk


# -- output -------------------------------------------------------------------------------


class LogPrinter:
    """Build log entries on stderr: time, message (errors in red, debug dim)."""

    def __init__(self, verbose: bool = False) -> None:
        from .output import console

        self.console = console(stderr=True)
        self.verbose = verbose

    def __call__(self, entry: dict[str, Any]) -> None:
        from rich.markup import escape

        level = str(entry.get("level") or "info")
        if level == "debug" and not self.verbose:
            return
        ts = str(entry.get("timestamp") or "")
        try:
            when = datetime.fromisoformat(ts.replace("Z", "+00:00")).astimezone()
            clock = when.strftime("%H:%M:%S")
        except ValueError:
            clock = ""
        style = {"error": "red", "warn": "yellow", "debug": "dim"}.get(level, "")
        msg = escape(str(entry.get("message") or ""))
        text = f"[{style}]{msg}[/]" if style else msg
        self.console.print(f"[dim]{clock}[/] {text}", highlight=False, soft_wrap=True)


def run_build(
    cp: ControlPlane,
    name: str,
    spec: dict[str, Any],
    *,
    cpu: int | None,
    memory: int | None,
    uploads: list[tuple[int, str, str, list[Path]]] | None = None,
    context: Path | None = None,
    verbose: bool = False,
) -> dict[str, Any]:
    """Requests a build, uploads COPY files (step index, src, dest, files), starts it and
    follows its log; raises CliError when it fails."""
    from .output import console

    err = console(stderr=True)
    req = request_build(cp, name, cpu=cpu, memory=memory)
    tid, bid = str(req["templateID"]), str(req["buildID"])
    err.print(f"[dim]template {tid}, build {bid}[/]", highlight=False)
    for index, src, dest, files in uploads or []:
        assert context is not None
        digest = files_hash(src, dest, context, files)
        with tar_files(context, files) as archive:
            sent = upload_files(cp, tid, digest, archive)
        err.print(
            f"[dim]{'uploaded' if sent else 'already uploaded'}: {src} ({len(files)} entries)[/]",
            highlight=False,
        )
        spec["steps"][index]["filesHash"] = digest
    start_build(cp, tid, bid, spec)
    final = follow_build(cp, tid, bid, LogPrinter(verbose))
    if final.get("status") != "ready":
        reason = final.get("reason") or {}
        raise CliError(f"build failed: {reason.get('message') or final.get('status')}")
    return {"templateID": tid, "buildID": bid, "name": name}


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


# -- commands -----------------------------------------------------------------------------


def register(
    app: typer.Typer, template_app: typer.Typer, state_of: Callable[[Any], CliState]
) -> None:
    @app.command("pull")
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
        """Pull an image on the server (progress per layer); with --name, make it a template."""
        if (start_cmd or ready_cmd) and not name:
            raise CliError("--start-cmd and --ready-cmd need --name")
        state = state_of(ctx)
        body: dict[str, Any] = {"image": image}
        registry = None
        if username or password:
            if not (username and password):
                raise CliError("--username and --password go together")
            registry = {"type": "registry", "username": username, "password": password}
            body["registry"] = registry
        pulled: dict[str, Any] | None = None
        with state.control() as cp:
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

    @app.command("build")
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
        no_cache: Annotated[
            bool, typer.Option("--no-cache", help="Ignore the step cache.")
        ] = False,
        cpu: Annotated[int | None, typer.Option("--cpu", min=1, help="vCPUs.")] = None,
        memory: Annotated[int | None, typer.Option("--memory", min=128, help="MB.")] = None,
        verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug log lines.")] = False,
    ) -> None:
        """Build a template from a Dockerfile (on the server, with the E2B build API)."""
        from ..builds.dockerfile import parse_dockerfile
        from .main import _pairs

        if path.is_dir():
            context, dockerfile = path, file or path / "Dockerfile"
        else:
            context, dockerfile = path.parent, file or path
        if not dockerfile.is_file():
            raise CliError(f"no Dockerfile at {dockerfile}")
        try:
            df = parse_dockerfile(dockerfile.read_text(), _pairs(build_arg, "--build-arg"))
        except CliError:
            raise
        except Exception as exc:  # DockerfileError (an AenvError) and decoding errors
            raise CliError(f"{dockerfile}: {getattr(exc, 'message', exc)}") from None
        for w in df.warnings:
            sys.stderr.write(f"aenv: warning: {w}\n")
        ignore = read_dockerignore(context)
        uploads = [
            (c.index, c.src, c.dest, context_files(context, c.src, ignore)) for c in df.copies
        ]
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

    @template_app.command("rm")
    def template_rm(
        ctx: typer.Context,
        templates: Annotated[
            list[str], typer.Argument(metavar="ID|NAME...", help="Templates to delete.")
        ],
    ) -> None:
        """Delete templates (and cancel their builds); prints each one removed."""
        failed = False
        with state_of(ctx).control() as cp:
            for t in templates:
                try:
                    cp.request("DELETE", f"/templates/{_seg(t)}", ok=(204, 200))
                except CliError as exc:
                    if exc.status is None:
                        raise
                    failed = True
                    sys.stderr.write(f"aenv: {t}: {exc.message}\n")
                    continue
                print(t, flush=True)
        if failed:
            raise typer.Exit(1)
