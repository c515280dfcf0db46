"""Bounded request field types: input that a sandbox or every later list would pay for is
refused with a 400 where it enters (a 1 MiB env value made every command of the sandbox fail,
a 50 MB metadata value made every list answer 52 MB).

E2B documents no bounds for metadata or envVars (both are free string maps in its OpenAPI);
the ones here are ours: envVars follow envd's rules (`aenv.envd.envrules`, the same ones envd
applies to `/init` and to each command), metadata is kept small enough to list thousands of
sandboxes in one page.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from aenv.envd.envrules import env_problem

MAX_METADATA_KEYS = 64
MAX_METADATA_KEY_BYTES = 256
MAX_METADATA_VALUE_BYTES = 4 * 1024
MAX_METADATA_TOTAL_BYTES = 64 * 1024


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_metadata(metadata: dict[str, str]) -> dict[str, str]:
    """`metadata` itself, or ValueError naming the first bound it breaks."""
    if len(metadata) > MAX_METADATA_KEYS:
        raise ValueError(f"at most {MAX_METADATA_KEYS} keys (got {len(metadata)})")
    total = 0
    for key, value in metadata.items():
        shown = repr(key[:64])
        if not key:
            raise ValueError("a key must not be empty")
        if "\0" in key or "\0" in value:
            raise ValueError(f"key {shown}: keys and values must not contain a NUL byte")
        key_len, value_len = _utf8_len(key), _utf8_len(value)
        if key_len > MAX_METADATA_KEY_BYTES:
            raise ValueError(f"key {shown}… longer than {MAX_METADATA_KEY_BYTES} bytes")
        if value_len > MAX_METADATA_VALUE_BYTES:
            raise ValueError(
                f"the value of {shown} is {value_len} bytes, more than {MAX_METADATA_VALUE_BYTES}"
            )
        total += key_len + value_len
    if total > MAX_METADATA_TOTAL_BYTES:
        raise ValueError(f"{total} bytes in all, more than {MAX_METADATA_TOTAL_BYTES}")
    return metadata


def check_env_vars(env_vars: dict[str, str]) -> dict[str, str]:
    """`env_vars` itself, or ValueError saying why no process could have it."""
    problem = env_problem(env_vars, what="variables")
    if problem:
        raise ValueError(problem)
    return env_vars


Metadata = Annotated[
    dict[str, str],
    Field(
        max_length=MAX_METADATA_KEYS,
        description=(
            f"at most {MAX_METADATA_KEYS} keys of 1-{MAX_METADATA_KEY_BYTES} bytes, values up "
            f"to {MAX_METADATA_VALUE_BYTES} bytes, {MAX_METADATA_TOTAL_BYTES} bytes in all"
        ),
    ),
    AfterValidator(check_metadata),
]

EnvVars = Annotated[
    dict[str, str],
    Field(
        description=(
            "names non-empty without '=' or NUL; values up to 32 KiB without NUL; 256 KiB in all"
        )
    ),
    AfterValidator(check_env_vars),
]
