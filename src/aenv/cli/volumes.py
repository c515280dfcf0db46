"""`aenv volume create|ls|rm|files|cp`, and `--volume NAME:PATH[:ro]` for `aenv start`.

Volumes are named by id or name; the file commands fetch the volume's token with the API
key and then speak the volume content API (`/volumecontent`) with it, as the SDK does."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, BinaryIO

import httpx
import typer

from .client import ControlPlane, server_message, transport_error, url_segment
from .errors import CliError
from .options import JsonFlagOpt, ListOutputOpt, QuietOpt
from .output import Column, Listing, print_listing, resolve_format
from .state import CliState, state_of

VolumeArg = Annotated[str, typer.Argument(metavar="VOLUME", help="Volume ID or name.")]


def mount_specs(values: list[str] | None) -> list[dict[str, Any]]:
    """`NAME:PATH[:ro]` options as E2B `volumeMounts` items (`readOnly` is aenv's)."""
    out: list[dict[str, Any]] = []
    for v in values or []:
        name, sep, rest = v.partition(":")
        path, _, mode = rest.partition(":")
        if not sep or not name or not path.startswith("/") or mode not in ("", "ro", "rw"):
            raise CliError(f"--volume {v!r}: expected NAME:/PATH or NAME:/PATH:ro")
        item: dict[str, Any] = {"name": name, "path": path}
        if mode == "ro":
            item["readOnly"] = True
        out.append(item)
    return out


def _find(cp: ControlPlane, ref: str) -> dict[str, Any]:
    """The volume (with its token) named by id or name."""
    try:
        return dict(cp.request("GET", f"/volumes/{url_segment(ref)}").json())
    except CliError as exc:
        if exc.status != 404:
            raise
    for v in cp.request("GET", "/volumes").json():
        if v.get("name") == ref:
            return dict(cp.request("GET", f"/volumes/{url_segment(v['volumeID'])}").json())
    raise CliError(f"no volume {ref!r}", status=404)


@contextlib.contextmanager
def _content(state: CliState, ref: str) -> Iterator[tuple[httpx.Client, str]]:
    """A client of the volume content API carrying the volume's token, and its id."""
    with state.control() as cp:
        vol = _find(cp, ref)
    headers = {"Authorization": f"Bearer {vol['token']}", "User-Agent": "aenv-cli"}
    with httpx.Client(
        base_url=state.url,
        headers=headers,
        verify=state.verify(),
        timeout=httpx.Timeout(60.0, read=None),
    ) as http:
        yield http, str(vol["volumeID"])


def _call(http: httpx.Client, method: str, path: str, ok: int = 200, **kw: Any) -> httpx.Response:
    try:
        resp = http.request(method, path, **kw)
    except httpx.TransportError as exc:
        raise transport_error(str(http.base_url), exc) from None
    if resp.status_code != ok:
        raise CliError(server_message(resp), status=resp.status_code)
    return resp


def volume_create(
    ctx: typer.Context, name: Annotated[str, typer.Argument(help="Letters, digits, _ and -.")]
) -> None:
    """Create a volume; prints its id.

    Examples:

    ```
    aenv volume create datasets
    aenv start -v datasets:/data
    ```
    """
    with state_of(ctx).control() as cp:
        resp = cp.request("POST", "/volumes", json={"name": name}, ok=(201,))
    print(resp.json()["volumeID"])


def volume_ls(
    ctx: typer.Context,
    output: ListOutputOpt = None,
    quiet: QuietOpt = False,
    json_out: JsonFlagOpt = False,
) -> None:
    """List volumes.

    Examples:

    ```
    aenv volume ls
    aenv volume ls -o json
    aenv volume ls -q
    ```
    """
    with state_of(ctx).control() as cp:
        items = cp.request("GET", "/volumes").json()
    print_listing(items, VOLUMES, resolve_format(output, json_flag=json_out), quiet)


VOLUMES = Listing(
    columns=(
        Column("VOLUME", lambda v: v.get("volumeID"), key=True),
        Column("NAME", lambda v: v.get("name")),
    ),
    id_of=lambda v: v.get("volumeID"),
    empty="no volumes",
    boxed=True,
)


def volume_rm(
    ctx: typer.Context,
    volumes: Annotated[list[str], typer.Argument(metavar="VOLUME...", help="IDs or names.")],
) -> None:
    """Delete volumes and their files (refused while a sandbox mounts one).

    Examples:

    ```
    aenv volume rm datasets
    ```
    """
    with state_of(ctx).control() as cp:
        for ref in volumes:
            vol = _find(cp, ref)
            cp.request("DELETE", f"/volumes/{url_segment(vol['volumeID'])}", ok=(204,))


def volume_files(
    ctx: typer.Context,
    volume: VolumeArg,
    path: Annotated[str, typer.Argument(help="Directory in the volume.")] = "/",
    depth: Annotated[int, typer.Option("--depth", min=1, help="Levels to list.")] = 1,
    output: ListOutputOpt = None,
    quiet: QuietOpt = False,
    json_out: JsonFlagOpt = False,
) -> None:
    """List the files of a volume (`-q`: their paths).

    Examples:

    ```
    aenv volume files datasets
    aenv volume files datasets /train --depth 3 -o json
    ```
    """
    with _content(state_of(ctx), volume) as (http, vid):
        items = _call(
            http, "GET", f"/volumecontent/{vid}/dir", params={"path": path, "depth": depth}
        ).json()
    print_listing(items, FILES, resolve_format(output, json_flag=json_out), quiet)


FILES = Listing(
    columns=(
        Column("PATH", lambda e: e.get("path"), fold=True),
        Column("TYPE", lambda e: e.get("type")),
        Column("SIZE", lambda e: e.get("size"), justify="right"),
        Column("MODE", lambda e: f"{int(e.get('mode') or 0):04o}"),
        Column("OWNER", lambda e: f"{e.get('uid')}:{e.get('gid')}"),
        Column("MODIFIED", lambda e: e.get("mtime")),
    ),
    id_of=lambda e: e.get("path"),
    empty="no files",
    boxed=True,
)


def volume_cp(
    ctx: typer.Context,
    src: Annotated[str, typer.Argument(help="LOCAL-FILE, VOLUME:/PATH or - (stdin).")],
    dst: Annotated[str, typer.Argument(help="VOLUME:/PATH, LOCAL-FILE or - (stdout).")],
) -> None:
    """Copy one file into or out of a volume (`VOLUME:/path` names the volume's side).

    Examples:

    ```
    aenv volume cp ./train.csv datasets:/train/train.csv
    aenv volume cp datasets:/train/train.csv - | head
    ```
    """
    state = state_of(ctx)
    src_vol, dst_vol = _remote(src), _remote(dst)
    if (src_vol is None) == (dst_vol is None):
        raise CliError("one side of `aenv volume cp` must be VOLUME:/PATH, the other local")
    if dst_vol is not None:
        ref, path = dst_vol
        with _content(state, ref) as (http, vid), _source(src) as data:
            _call(
                http,
                "PUT",
                f"/volumecontent/{vid}/file",
                ok=201,
                params={"path": path},
                content=iter(lambda: data.read(1 << 20), b""),
                headers={"Content-Type": "application/octet-stream"},
            )
        return
    assert src_vol is not None
    ref, path = src_vol
    with _content(state, ref) as (http, vid):
        try:
            with http.stream("GET", f"/volumecontent/{vid}/file", params={"path": path}) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise CliError(server_message(resp), status=resp.status_code)
                with _sink(dst) as out:
                    for chunk in resp.iter_bytes():
                        out.write(chunk)
        except httpx.TransportError as exc:
            raise transport_error(state.url, exc) from None


def _remote(arg: str) -> tuple[str, str] | None:
    """(volume, path) for `VOLUME:/PATH`; None for a local path."""
    name, sep, path = arg.partition(":")
    if sep and name and path.startswith("/") and "/" not in name:
        return name, path
    return None


@contextlib.contextmanager
def _source(path: str) -> Iterator[BinaryIO]:
    if path == "-":
        yield sys.stdin.buffer
        return
    if not Path(path).is_file():
        raise CliError(f"{path}: no such file")
    with open(path, "rb") as f:
        yield f


@contextlib.contextmanager
def _sink(path: str) -> Iterator[BinaryIO]:
    if path == "-":
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    with open(path, "wb") as f:
        yield f
