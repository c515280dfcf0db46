"""How the CLI checks an `https` server: AENV_TLS_VERIFY (`true`, `false` or a CA file)."""

from __future__ import annotations

import ssl
from pathlib import Path

import certifi

from .errors import CliError

_OFF = {"false", "0", "no", "off"}
_ON = {"true", "1", "yes", "on", ""}


def verify_option(setting: str, own_cert: Path | None) -> ssl.SSLContext | bool:
    """httpx's `verify`: the public CAs plus `own_cert` (the node's AENV_TLS_CERT, when this
    user can read it: a self-signed node then needs no set-up on its own host), nothing
    (`false`), or only the CAs of the file `setting` names."""
    value = setting.strip()
    if value.lower() in _OFF:
        return False
    if value.lower() in _ON:
        if own_cert is None:
            return True
        ctx = ssl.create_default_context(cafile=certifi.where())
        try:
            ctx.load_verify_locations(cafile=str(own_cert))
        except (OSError, ssl.SSLError):
            return True  # not readable here (not root): the public CAs alone decide
        return ctx
    try:
        return ssl.create_default_context(cafile=value)
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise CliError(f"AENV_TLS_VERIFY={value}: not a usable CA file ({reason})") from None
