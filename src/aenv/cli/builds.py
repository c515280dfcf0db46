"""Template builds over the server's API, the parts `aenv build` and `aenv pull --name`
share: the E2B build calls (`POST /v3/templates`, `POST /v2/templates/{id}/builds/{bid}`,
the log through `GET .../status?logsOffset=`) and the build context: COPY sources picked
like Docker does (`.dockerignore`), packed as tar.gz per source, named by a content hash and
PUT to the URL the server hands out, like the E2B SDK.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import stat
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import httpx

from .client import ControlPlane, server_message, transport_error, url_segment
from .errors import CliError

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
        "POST",
        f"/v2/templates/{url_segment(template_id)}/builds/{url_segment(build_id)}",
        json=spec,
        ok=(202,),
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
    path = f"/templates/{url_segment(template_id)}/builds/{url_segment(build_id)}/status"
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
        "GET", f"/templates/{url_segment(template_id)}/files/{url_segment(digest)}", ok=(201, 200)
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
