"""What every command reads from the root of the command line: the server URL, the API key
and the node's settings (`CliState`, on the root typer context)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from .client import ControlPlane
from .connect import EnvdClient
from .errors import CliError
from .tls import verify_option

if TYPE_CHECKING:
    from ..config import Settings


@dataclass
class CliState:
    url_option: str | None = None
    api_key_option: str | None = None
    _settings: Settings | None = field(default=None, repr=False)

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
        listen = self.settings().listen
        host, _, port = listen.rpartition(":")
        if host in ("", "0.0.0.0", "::", "[::]"):
            host = "127.0.0.1"
        return f"{self.settings().scheme}://{host}:{port}"

    def key_file(self) -> Path:
        return self.settings().api_key_file

    def verify(self) -> ssl.SSLContext | bool:
        settings = self.settings()
        return verify_option(settings.tls_verify, settings.tls_cert)

    def api_key(self) -> tuple[str | None, str]:
        """(key or None, a hint for a 401). Never creates a key (the server does)."""
        if self.api_key_option:
            return self.api_key_option, "check --api-key / AENV_API_KEY"
        settings = self.settings()
        if settings.api_key:
            return settings.api_key, "check api_key in the aenv config file"
        path = self.key_file()
        try:
            key = path.read_text().strip()
        except FileNotFoundError:
            return None, f"no API key: set AENV_API_KEY or --api-key ({path} does not exist)"
        except OSError as exc:
            reason = exc.strerror or str(exc)
            return None, f"no API key: set AENV_API_KEY or --api-key (cannot read {path}: {reason})"
        return (key or None), f"the key in {path} was not accepted; set AENV_API_KEY"

    def control(self) -> ControlPlane:
        key, hint = self.api_key()
        return ControlPlane(self.url, key, key_hint=hint, verify=self.verify())

    def envd(self, sandbox_id: str, token: str | None, user: str | None = None) -> EnvdClient:
        return EnvdClient(self.url, sandbox_id, token, user=user, verify=self.verify())


def state_of(ctx: typer.Context) -> CliState:
    """The root's state (made on first use when a command runs without the root callback,
    as in tests that invoke a sub-app)."""
    obj = ctx.find_root().obj
    if not isinstance(obj, CliState):
        obj = CliState()
        ctx.find_root().obj = obj
    return obj
