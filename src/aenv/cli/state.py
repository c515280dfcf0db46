"""What every command reads from the root of the command line: the server URL, the API key
and the node's settings (`CliState`, on the root typer context).

Where the URL and key come from, first found wins, each on its own:

1. the flags `--url` / `--api-key`, and `--context NAME` (a flag too: its URL and key);
2. `AENV_URL` / `AENV_API_KEY`;
3. E2B's variables, as its SDK reads them: `E2B_API_URL`, else `E2B_DOMAIN` (the API at
   `https://api.<domain>`); `E2B_API_KEY`;
4. the saved context (credentials.py): the one `AENV_CONTEXT` names, else the current one;
   its key only for its own URL;
5. the local node's defaults (its listen address; `api_key` in its config, then
   `$AENV_HOME/secrets/api-key`).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from ..envd_client import EnvdClient, EnvdTarget
from .client import USER_AGENT, ControlPlane
from .credentials import Contexts, Credentials, credentials_path, load_contexts, normalize_url
from .errors import CliError
from .tls import verify_option

if TYPE_CHECKING:
    from ..config import Settings


def env(name: str) -> str | None:
    """An environment variable, None when unset or blank (an empty export is no choice)."""
    value = os.environ.get(name, "").strip()
    return value or None


@dataclass
class CliState:
    url_option: str | None = None
    api_key_option: str | None = None
    debug: bool = False
    context_option: str | None = None
    _settings: Settings | None = field(default=None, repr=False)
    _contexts: Contexts | None = field(default=None, repr=False)

    # -- contexts ---------------------------------------------------------------------------

    def contexts(self) -> Contexts:
        """What `aenv auth` and `aenv context` stored (read once per command)."""
        if self._contexts is None:
            self._contexts = load_contexts(credentials_path())
        return self._contexts

    def context_name(self) -> tuple[str | None, str]:
        """The selected context's name (None: none) and what selected it."""
        if self.context_option:
            return self.context_option, "--context"
        chosen = env("AENV_CONTEXT")
        if chosen:
            return chosen, "AENV_CONTEXT"
        return self.contexts().current, "the current context"

    def context(self) -> tuple[str, Credentials] | None:
        """The selected context; one named by --context or AENV_CONTEXT must exist."""
        name, how = self.context_name()
        if name is None:
            return None
        creds = self.contexts().contexts.get(name)
        if creds is None:
            if how == "the current context":
                return None
            raise CliError(f"no context {name!r} ({how}); see `aenv context ls`")
        return name, creds

    def credentials(self) -> Credentials | None:
        """The selected context's URL and key (None without one)."""
        found = self.context()
        return found[1] if found else None

    def _context_source(self) -> str:
        found = self.context()
        name = found[0] if found else "?"
        return f"context {name!r} in {credentials_path()}"

    # -- the URL and the key ------------------------------------------------------------------

    def _explicit_url(self) -> tuple[str, str] | None:
        """A URL from a flag or the environment, and where it came from."""
        if self.url_option:
            return self.url_option, "--url"
        if self.context_option and self.credentials() is not None:
            return None  # --context is a flag: it outranks the environment
        for name in ("AENV_URL", "E2B_API_URL"):
            value = env(name)
            if value:
                return value, name
        domain = env("E2B_DOMAIN")
        if domain:
            return f"https://api.{domain}", "E2B_DOMAIN"
        return None

    def _explicit_key(self) -> tuple[str, str] | None:
        if self.api_key_option:
            return self.api_key_option, "--api-key"
        if self.context_option and self._stored_key() is not None:
            return None
        for name in ("AENV_API_KEY", "E2B_API_KEY"):
            value = env(name)
            if value:
                return value, name
        return None

    def _stored_key(self) -> Credentials | None:
        """The selected context when its key may be sent: to its own URL only."""
        creds = self.credentials()
        if creds is None:
            return None
        if self.url_option and self.url_option.rstrip("/") != creds.url:
            return None
        if not self.context_option:
            explicit = self._explicit_url()
            if explicit is not None and explicit[0].rstrip("/") != creds.url:
                return None
        return creds

    def url_source(self) -> str:
        explicit = self._explicit_url()
        if explicit is not None:
            return explicit[1]
        if self.credentials() is not None:
            return self._context_source()
        return "local node settings (AENV_LISTEN)"

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
        explicit = self._explicit_url()
        if explicit is not None:
            return normalize_url(explicit[0])
        creds = self.credentials()
        if creds is not None:
            return creds.url
        listen = self.settings().listen
        host, _, port = listen.rpartition(":")
        if host in ("", "0.0.0.0", "::", "[::]"):
            host = "127.0.0.1"
        return f"{self.settings().scheme}://{host}:{port}"

    def key_source(self) -> str:
        explicit = self._explicit_key()
        if explicit is not None:
            return explicit[1]
        if self._stored_key() is not None:
            return self._context_source()
        if self.settings().api_key:
            return "api_key in the aenv config file"
        return str(self.key_file())

    def key_file(self) -> Path:
        return self.settings().api_key_file

    def verify(self) -> ssl.SSLContext | bool:
        settings = self.settings()
        return verify_option(settings.tls_verify, settings.tls_cert)

    def api_key(self) -> tuple[str | None, str]:
        """(key or None, a hint for a 401). Never creates a key (the server does)."""
        explicit = self._explicit_key()
        if explicit is not None:
            return explicit[0], f"check {explicit[1]}"
        creds = self._stored_key()
        if creds is not None:
            return creds.api_key, (
                f"the key of {self._context_source()} was not accepted; run `aenv auth`"
            )
        settings = self.settings()
        if settings.api_key:
            return settings.api_key, "check api_key in the aenv config file"
        path = self.key_file()
        try:
            key = path.read_text().strip()
        except FileNotFoundError:
            return None, (
                f"no API key: run `aenv auth`, or set AENV_API_KEY or --api-key "
                f"({path} does not exist)"
            )
        except OSError as exc:
            reason = exc.strerror or str(exc)
            return None, (
                f"no API key: run `aenv auth`, or set AENV_API_KEY or --api-key "
                f"(cannot read {path}: {reason})"
            )
        return (key or None), f"the key in {path} was not accepted; set AENV_API_KEY"

    def control(self) -> ControlPlane:
        key, hint = self.api_key()
        return ControlPlane(self.url, key, key_hint=hint, verify=self.verify())

    def envd(self, sandbox_id: str, token: str | None, user: str | None = None) -> EnvdClient:
        target = EnvdTarget.routed(
            self.url,
            sandbox_id,
            token,
            headers={"User-Agent": USER_AGENT},
            verify=self.verify(),
        )
        return EnvdClient(target, user=user)

    def envd_of(self, sandbox_id: str, user: str | None = None) -> EnvdClient:
        """An envd client for a running sandbox (its access token looked up); a paused one
        is a clear error rather than a silent resume."""
        with self.control() as cp:
            info = cp.get_sandbox(sandbox_id)
        if info.get("state") == "paused":
            raise CliError(
                f"sandbox {sandbox_id} is paused; resume it with `aenv resume {sandbox_id}`"
            )
        return self.envd(sandbox_id, info.get("envdAccessToken"), user)


def state_of(ctx: typer.Context) -> CliState:
    """The root's state (made on first use when a command runs without the root callback,
    as in tests that invoke a sub-app)."""
    obj = ctx.find_root().obj
    if not isinstance(obj, CliState):
        obj = CliState()
        ctx.find_root().obj = obj
    return obj
