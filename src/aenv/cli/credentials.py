"""The credentials `aenv auth` stores: a server URL and its API key, in
`$XDG_CONFIG_HOME/aenv/credentials` (default `~/.config/aenv/credentials`), mode 0600 in a
0700 directory.

Precedence (see `CliState`): `--url`/`--api-key` and `AENV_URL`/`AENV_API_KEY` first, then
this file, then the local node's defaults (its listen address, `$AENV_HOME/secrets/api-key`).
The file's key is only sent to the file's URL: with another `--url`, the key comes from
the options or the node defaults, never from here.
"""

from __future__ import annotations

import contextlib
import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .errors import CliError


@dataclass(frozen=True)
class Credentials:
    url: str
    api_key: str


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


def load_credentials(path: Path) -> Credentials | None:
    """The stored credentials; None when there is no file. A broken file is an error
    naming it (fix it with `aenv auth` or `aenv auth --logout`)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(raw.decode())
        url, key = data.get("url"), data.get("api_key")
        if not isinstance(url, str) or not isinstance(key, str) or not url or not key:
            raise ValueError("url and api_key must be non-empty strings")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CliError(
            f"bad credentials file {path} ({exc}); run `aenv auth` or `aenv auth --logout`"
        ) from None
    return Credentials(url.rstrip("/"), key)


def save_credentials(path: Path, creds: Credentials) -> None:
    """Write atomically: the file is 0600 from its creation, its directory 0700."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    text = (
        "# aenv credentials, written by `aenv auth` (remove with `aenv auth --logout`)\n"
        f"url = {json.dumps(creds.url)}\n"
        f"api_key = {json.dumps(creds.api_key)}\n"
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def remove_credentials(path: Path) -> bool:
    """False when there was nothing to remove."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
