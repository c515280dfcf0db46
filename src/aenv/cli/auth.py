"""`aenv auth` (check and store a server URL and API key) and `aenv status` (which server,
whether it answers and takes the key, its version, capacity and sandboxes)."""

from __future__ import annotations

import sys
import time
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from .. import __version__
from .client import ControlPlane
from .credentials import (
    DEFAULT_CONTEXT,
    Credentials,
    check_context_name,
    credentials_path,
    load_contexts,
    normalize_url,
    save_contexts,
)
from .errors import CliError
from .options import OutputFormat, note
from .output import format_mb, print_document
from .state import CliState, state_of


def _interactive() -> bool:
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False


def _ask(label: str, default: str | None, *, secret: bool) -> str:
    """A prompt on a terminal; one line of stdin otherwise (`printf 'URL\\nKEY\\n' | aenv
    auth`)."""
    if _interactive():
        value = typer.prompt(
            label,
            default=default or "",
            hide_input=secret,
            show_default=bool(default) and not secret,
        )
        return str(value).strip()
    sys.stderr.write(f"{label}: ")
    sys.stderr.flush()
    line = sys.stdin.readline()
    sys.stderr.write("\n")
    return line.strip() or (default or "")


def check_credentials(state: CliState, url: str, api_key: str) -> None:
    """One authenticated request: a refused key or an unreachable server is a CliError."""
    with ControlPlane(url, api_key, timeout=15.0, verify=state.verify()) as cp:
        try:
            cp.request("GET", "/v2/sandboxes", params={"limit": "1"})
        except CliError as exc:
            if exc.status == 401:
                raise CliError(
                    f"the server at {url} refused the API key ({exc.message}); nothing stored",
                    status=401,
                ) from None
            if exc.status is None:
                raise CliError(f"{exc.message}; nothing stored") from None
            if exc.status == 404:
                raise CliError(
                    f"{url} does not look like an aenv/E2B server (GET /v2/sandboxes: 404); "
                    "nothing stored",
                    status=404,
                ) from None
            raise


def auth(
    ctx: typer.Context,
    url: Annotated[
        str | None, typer.Option("--url", help="Server URL (prompted for when missing).")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", help="API key (prompted for, hidden, when missing)."),
    ] = None,
    logout: Annotated[
        bool, typer.Option("--logout", help="Remove the context's stored URL and key.")
    ] = False,
) -> None:
    """Log in to a server: check a URL and API key against it, then save them as a context.

    They go to the current context ("default" when there is none), or to the one
    --context NAME (or AENV_CONTEXT) names; a new context becomes current only when none
    is (`aenv context use NAME` switches). The file is $XDG_CONFIG_HOME/aenv/credentials
    (default ~/.config/aenv/credentials, mode 0600). Flags and AENV_*/E2B_* variables still
    override it. Nothing is stored when the server is unreachable or refuses the key.

    Examples:

    ```
    aenv auth                                     # prompts for both
    aenv auth --url https://aenv.example.com --api-key e2b_...
    aenv auth --context staging --url https://aenv.staging.example.com
    printf '%s\\n%s\\n' "$URL" "$KEY" | aenv auth    # from a script
    aenv auth --logout                            # forget the current context
    ```
    """
    path = credentials_path()
    state = state_of(ctx)
    stored = load_contexts(path)
    name = state.context_name()[0] or DEFAULT_CONTEXT
    if logout:
        if name in stored.contexts:
            del stored.contexts[name]
            if stored.current == name:
                stored.current = None
            save_contexts(path, stored)
            print(f"removed context {name} from {path}")
        else:
            note(f"no stored credentials for context {name!r} ({path})")
        return
    # The root's --url/--api-key (or AENV_URL/AENV_API_KEY) are the prompts' defaults.
    if url is None:
        url = state.url_option or _ask("Server URL", _default_url(state), secret=False)
    url = normalize_url(url)
    if api_key is None:
        api_key = state.api_key_option or _ask("API key", None, secret=True)
    api_key = api_key.strip()
    if not api_key:
        raise CliError("no API key given; nothing stored")
    check_credentials(state, url, api_key)
    check_context_name(name)
    stored.contexts[name] = Credentials(url, api_key)
    if stored.current is None:
        stored.current = name
    save_contexts(path, stored)
    print(f"authenticated to {url}; saved as context {name} in {path}")
    if stored.current != name:
        note(f"the current context is still {stored.current}; `aenv context use {name}`")


def _default_url(state: CliState) -> str | None:
    try:
        return state.url
    except CliError:
        return None


# -- status ---------------------------------------------------------------------------------


def _gather(state: CliState) -> tuple[dict[str, Any], CliError | None]:
    """What `status` shows, and the first failure (unreachable, refused key)."""
    out: dict[str, Any] = {
        "url": state.url,
        "urlSource": state.url_source(),
        "cliVersion": __version__,
        "reachable": False,
        "authenticated": False,
    }
    key, hint = state.api_key()
    out["keySource"] = state.key_source() if key else None
    with ControlPlane(state.url, key, key_hint=hint, timeout=15.0, verify=state.verify()) as cp:
        t0 = time.monotonic()
        try:
            cp.request("GET", "/health", ok=(200, 204))
        except CliError as exc:
            if exc.status is None:  # unreachable; any HTTP answer means it is up
                return out, exc
        out["reachable"] = True
        out["latencyMs"] = round((time.monotonic() - t0) * 1000, 1)
        if not key:
            return out, CliError(hint)
        try:
            nodes = cp.request("GET", "/nodes").json()
        except CliError as exc:
            if exc.status == 401:
                return out, exc
            nodes = None
            out["nodesError"] = exc.message
        try:
            sandboxes = cp.list_sandboxes()
        except CliError as exc:
            if exc.status == 401:
                return out, exc
            raise
    out["authenticated"] = True
    counts: dict[str, int] = {}
    for sb in sandboxes:
        st = str(sb.get("state") or "unknown")
        counts[st] = counts.get(st, 0) + 1
    out["sandboxes"] = counts
    if isinstance(nodes, list):
        out["nodes"] = [_node_summary(n) for n in nodes if isinstance(n, dict)]
        versions = sorted({str(n.get("version")) for n in nodes if n.get("version")})
        out["serverVersion"] = ", ".join(versions) or None
    return out, None


def _node_summary(n: dict[str, Any]) -> dict[str, Any]:
    m = n.get("metrics") or {}
    return {
        "nodeID": n.get("nodeID"),
        "status": n.get("status"),
        "version": n.get("version"),
        "cpuCount": m.get("cpuCount"),
        "cpuPercent": m.get("cpuPercent"),
        "allocatedCPU": m.get("allocatedCPU"),
        "memoryTotalMB": _mb(m.get("memoryTotalBytes")),
        "memoryUsedMB": _mb(m.get("memoryUsedBytes")),
        "allocatedMemoryMB": _mb(m.get("allocatedMemoryBytes")),
        "memoryBudgetMB": _mb(m.get("memoryBudgetBytes")),
        "sandboxCounts": n.get("sandboxCounts") or {"running": n.get("sandboxCount", 0)},
        "runtime": n.get("runtime") or {},
    }


def _mb(value: Any) -> int | None:
    return int(value) // (1024 * 1024) if isinstance(value, int | float) else None


def _status_table(info: dict[str, Any]) -> Table:
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")

    def row(name: str, value: str, style: str = "") -> None:
        table.add_row(name, Text(value, style=style))

    row("server", f"{info['url']}  (from {info['urlSource']})")
    if info["reachable"]:
        row("reachable", f"yes ({info.get('latencyMs')} ms)", "green")
    else:
        row("reachable", "no", "red")
    if info["authenticated"]:
        row("authenticated", f"yes (key from {info['keySource']})", "green")
    elif info["reachable"]:
        row("authenticated", "no", "red")
    row("server version", str(info.get("serverVersion") or "-"))
    row("cli version", str(info["cliVersion"]))
    for n in info.get("nodes") or []:
        budget = n.get("memoryBudgetMB")
        row(
            f"node {n.get('nodeID')}",
            f"{n.get('status')}; CPU {n.get('cpuPercent')}% of {n.get('cpuCount')} cores "
            f"({n.get('allocatedCPU')} vCPUs allocated); memory "
            f"{format_mb(n.get('memoryUsedMB'))} used of {format_mb(n.get('memoryTotalMB'))}, "
            f"{format_mb(n.get('allocatedMemoryMB'))} allocated"
            + (f" of a {format_mb(budget)} budget" if budget else ""),
        )
        rt = n.get("runtime") or {}
        if rt.get("backend"):
            accel = f" ({rt['accelerator']})" if rt.get("accelerator") else ""
            row("  backend", f"{rt['backend']}{accel}")
    if "sandboxes" in info:
        counts = info["sandboxes"]
        text = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"
        row("sandboxes", text)
    return table


def status(
    ctx: typer.Context,
    output: Annotated[
        OutputFormat, typer.Option("--output", "-o", help="Output format.")
    ] = OutputFormat.table,
) -> None:
    """Show the server in use: reachable, authenticated, version, capacity, sandboxes.

    Exits 1 (after the report) when the server cannot be reached or refuses the key.

    Examples:

    ```
    aenv status
    aenv status -o json | jq .sandboxes
    AENV_URL=http://10.0.0.5:8000 aenv status
    ```
    """
    state = state_of(ctx)
    info, error = _gather(state)
    if error is not None and output in (OutputFormat.json, OutputFormat.yaml):
        info["error"] = error.message
    print_document(info, output, _status_table)
    if error is not None:
        raise error
