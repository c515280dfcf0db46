"""URLs in logs and start-up lines keep everything but the password."""

from __future__ import annotations

import pytest

from aenv.redact import url_without_password


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@redis.internal:6379/0", "redis://:***@redis.internal:6379/0"),
        ("rediss://aenv:s3cret@10.0.0.2:6380/1", "rediss://aenv:***@10.0.0.2:6380/1"),
        ("redis://redis.internal:6379/0", "redis://redis.internal:6379/0"),
        ("redis://user@host/0", "redis://user@host/0"),
        ("http://a:p%40ss@[::1]:8000/x", "http://a:***@[::1]:8000/x"),
    ],
)
def test_the_password_is_masked_and_the_rest_kept(url: str, shown: str) -> None:
    assert url_without_password(url) == shown
    assert "s3cret" not in url_without_password(url)


def test_what_cannot_be_parsed_is_not_shown() -> None:
    assert url_without_password("http://[::1:8000/:secret@") == "<url>"
