"""What may be printed of a setting that can carry a secret: a URL without its password
(`redis://:secret@host/0` is logged as `redis://:***@host/0`)."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def url_without_password(url: str) -> str:
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL we can take apart: show none of it
        return "<url>"
    if password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
