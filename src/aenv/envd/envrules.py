"""What an environment variable may be: the rules the control plane applies to a create's
``envVars`` and envd to ``/init`` and to each command's ``envs``.

Standard library only (this module ships inside the envd bundle; the API imports it too, so
both sides refuse the same input). A process's whole environment goes through ``execve``,
where Linux refuses one ``NAME=value`` string over 128 KiB and the sum of arguments and
environment over ``ARG_MAX``: a sandbox-wide variable past those bounds makes every later
command fail, so such input is refused where it enters. E2B documents no limits; these are
ours, well inside the kernel's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_ENV_VARS = 1024
MAX_ENV_NAME_BYTES = 1024
MAX_ENV_VALUE_BYTES = 32 * 1024
# Names and values of one mapping together; the base environment, the sandbox's envVars and
# a command's envs together stay well under the 2 MiB ARG_MAX of a default 8 MiB stack.
MAX_ENV_TOTAL_BYTES = 256 * 1024


def env_problem(envs: Mapping[Any, Any], what: str = "envVars") -> str | None:
    """Why `envs` cannot be a process environment, or None when it can."""
    if len(envs) > MAX_ENV_VARS:
        return f"{what}: at most {MAX_ENV_VARS} variables (got {len(envs)})"
    total = 0
    for name, value in envs.items():
        if not isinstance(name, str) or not isinstance(value, str):
            return f"{what}: names and values must be strings"
        shown = repr(name[:64])
        if not name:
            return f"{what}: a variable name must not be empty"
        if "=" in name:
            return f"{what}: variable name {shown} must not contain '='"
        if "\0" in name:
            return f"{what}: variable name {shown} must not contain a NUL byte"
        if "\0" in value:
            return f"{what}: the value of {shown} must not contain a NUL byte"
        name_len = len(name.encode("utf-8", "surrogatepass"))
        value_len = len(value.encode("utf-8", "surrogatepass"))
        if name_len > MAX_ENV_NAME_BYTES:
            return f"{what}: variable name {shown}… longer than {MAX_ENV_NAME_BYTES} bytes"
        if value_len > MAX_ENV_VALUE_BYTES:
            return (
                f"{what}: the value of {shown} is {value_len} bytes, "
                f"more than {MAX_ENV_VALUE_BYTES}"
            )
        total += name_len + value_len + 2
    if total > MAX_ENV_TOTAL_BYTES:
        return f"{what}: {total} bytes in all, more than {MAX_ENV_TOTAL_BYTES}"
    return None
