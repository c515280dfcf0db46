"""What every command reads from the root of the command line: the server URL, the API key
and the node's settings (`CliState`, on the root typer context).

Where the URL and key come from, first found wins: `--url`/`--api-key` (or `AENV_URL`/
`AENV_API_KEY`), the credentials `aenv auth` stored (credentials.py; its key only for its
URL), then the local node's defaults (its listen address; `api_key` in its config, then
`$AENV_HOME/secrets/api-key`)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from ..envd_client import EnvdClient, EnvdTarget
from .client import USER_AGENT, ControlPlane
from .credentials import Credentials, credentials_path, load_credentials
from .errors import CliError
from .tls import verify_option

if TYPE_CHECKING:
    from ..config import Settings


@dataclass
class CliState:
    url_option: str | None = None
    api_key_option: str | None = None
    debug: bool = False
    _settings: Settings | None = field(default=None, repr=False)
    _credentials: Credentials | None = field(default=None, repr=False)
    _credentials_read: bool = field(default=False, repr=False)

    def credentials(self) -> Credentials | None:
        """What `aenv auth` stored (None without a file)."""
        if not self._credentials_read:
            self._credentials = load_credentials(credentials_path())
            self._credentials_read = True
        return self._credentials

    def _stored_key(self) -> Credentials | None:
        """The stored credentials when their key may be sent: to their own URL only."""
        creds = self.credentials()
        if creds is None:
            return None
        if self.url_option and self.url_option.rstrip("/") != creds.url:
            return None
        return creds

    def url_source(self) -> str:
        if self.url_option:
            return "--url / AENV_URL"
        if self.credentials() is not None:
            return f"credentials file {credentials_path()}"
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
        if self.url_option:
            return self.url_option.rstrip("/")
        creds = self.credentials()
        if creds is not None:
            return creds.url
        listen = self.settings().listen
        host, _, port = listen.rpartition(":")
        if host in ("", "0.0.0.0", "::", "[::]"):
            host = "127.0.0.1"
        return f"{self.settings().scheme}://{host}:{port}"

    def key_source(self) -> str:
        if self.api_key_option:
            return "--api-key / AENV_API_KEY"
        if self._stored_key() is not None:
            return f"credentials file {credentials_path()}"
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
        if self.api_key_option:
            return self.api_key_option, "check --api-key / AENV_API_KEY"
        creds = self._stored_key()
        if creds is not None:
            return creds.api_key, (
                f"the key stored in {credentials_path()} was not accepted; run `aenv auth`"
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
