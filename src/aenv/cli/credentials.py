"""The contexts `aenv auth` and `aenv context` store: named servers (a URL and its API
key) and which one is current, in `$XDG_CONFIG_HOME/aenv/credentials` (default
`~/.config/aenv/credentials`), mode 0600 in a 0700 directory, as TOML:

    current = "default"
    [contexts.default]
    url = "https://aenv.example.com"
    api_key = "e2b_..."

The file of one server that `aenv auth` wrote before contexts (top-level `url` and
`api_key`) reads as the context "default", current; it is rewritten in the new shape the
next time something is saved, so nothing needs migrating by hand.

Precedence (see `CliState`): flags, then AENV_* and E2B_* variables, then the selected
context, then the local node's defaults. A context's key is only sent to the context's URL:
with another `--url`, the key comes from elsewhere, never from here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CliError

DEFAULT_CONTEXT = "default"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


@dataclass(frozen=True)
class Credentials:
    url: str
    api_key: str


@dataclass
class Contexts:
    """Every stored context, in the order they were added, and the current one's name."""

    contexts: dict[str, Credentials] = field(default_factory=dict)
    current: str | None = None

    def current_credentials(self) -> Credentials | None:
        return self.contexts.get(self.current) if self.current else None


def check_context_name(name: str) -> str:
    if not _NAME.match(name):
        raise CliError(f"bad context name {name!r}: letters, digits, '.', '_' and '-', at most 63")
    return name


def credentials_path(environ: dict[str, str] | None = None) -> Path:
    """`$XDG_CONFIG_HOME/aenv/credentials`, or `~/.config/aenv/credentials` when the
    variable is unset, empty or relative (as the XDG spec says)."""
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".config"
    return base / "aenv" / "credentials"


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url:
        raise CliError("the server URL is empty")
    if "://" not in url:
        url = "http://" + url
    scheme = url.partition("://")[0].lower()
    if scheme not in ("http", "https"):
        raise CliError(f"the server URL must be http:// or https://, got {url!r}")
    return url


def _entry(data: object, where: str) -> Credentials:
    if not isinstance(data, dict):
        raise ValueError(f"{where} is not a table")
    url, key = data.get("url"), data.get("api_key")
    if not isinstance(url, str) or not isinstance(key, str) or not url or not key:
        raise ValueError(f"{where}: url and api_key must be non-empty strings")
    return Credentials(url.rstrip("/"), key)


def load_contexts(path: Path) -> Contexts:
    """The stored contexts (none without a file). A broken file is an error naming it (fix
    it with `aenv auth` or `aenv auth --logout`)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Contexts()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(raw.decode())
        if "contexts" not in data:  # the one-server file of before contexts
            return Contexts({DEFAULT_CONTEXT: _entry(data, "the file")}, DEFAULT_CONTEXT)
        table = data["contexts"]
        if not isinstance(table, dict):
            raise ValueError("contexts is not a table")
        found = {str(n): _entry(v, f"context {n!r}") for n, v in table.items()}
        current = data.get("current")
        if current is not None and (not isinstance(current, str) or current not in found):
            raise ValueError(f"current context {current!r} is not defined")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CliError(
            f"bad credentials file {path} ({exc}); run `aenv auth` or `aenv auth --logout`"
        ) from None
    return Contexts(found, current)


def save_contexts(path: Path, stored: Contexts) -> None:
    """Write atomically: the file is 0600 from its creation, its directory 0700; no
    contexts left removes the file."""
    if not stored.contexts:
        remove_credentials(path)
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    lines = ["# aenv contexts, written by `aenv auth` and `aenv context` (0600: keys inside)"]
    if stored.current:
        lines.append(f"current = {json.dumps(stored.current)}")
    for name, creds in stored.contexts.items():
        lines += [
            "",
            f"[contexts.{json.dumps(name)}]",
            f"url = {json.dumps(creds.url)}",
            f"api_key = {json.dumps(creds.api_key)}",
        ]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def load_credentials(path: Path) -> Credentials | None:
    """The current context's server and key (None without one)."""
    return load_contexts(path).current_credentials()


def save_credentials(
    path: Path, creds: Credentials, name: str = DEFAULT_CONTEXT, *, make_current: bool = True
) -> None:
    """Store `creds` as context `name` (others are kept); current when asked, or when no
    context is current."""
    stored = load_contexts(path)
    stored.contexts[check_context_name(name)] = creds
    if make_current or stored.current is None:
        stored.current = name
    save_contexts(path, stored)


def remove_credentials(path: Path) -> bool:
    """Remove the whole file; False when there was nothing to remove."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
