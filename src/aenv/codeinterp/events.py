"""What `/execute` streams: one JSON object per line, made from kernel messages.

Pure (standard library only): the Jupyter message → event mapping and the NDJSON framing
the SDK parses (`e2b_code_interpreter.models.parse_output`), tested on the host.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

Event = dict[str, Any]

# MIME type of a display bundle → the SDK's `Result` field. The rest goes to `extra`.
MIME_FIELDS: dict[str, str] = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}

LANGUAGES = ("python", "bash")
_ALIASES = {"py": "python", "python3": "python", "ipython": "python", "sh": "bash", "shell": "bash"}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def ndjson(event: Event) -> bytes:
    """One event as a line of the response (no ASCII escaping: the SDK reads UTF-8)."""
    return json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def now() -> str:
    return datetime.now(UTC).isoformat()


def stream(name: str, text: str, timestamp: str | None = None) -> Event:
    return {"type": name, "text": text, "timestamp": timestamp or now()}


def error(name: str, value: str, traceback: str) -> Event:
    return {"type": "error", "name": name, "value": value, "traceback": traceback}


def count(execution_count: int) -> Event:
    return {"type": "number_of_executions", "execution_count": execution_count}


def end() -> Event:
    return {"type": "end_of_execution"}


def result(bundle: dict[str, Any], is_main: bool) -> Event:
    """A display bundle (`display_data` / `execute_result` content `data`) as a result.

    A repr of a str keeps no quotes (`'abc'` → `abc`), as E2B's server shows it."""
    ev: Event = {"type": "result", "is_main_result": is_main}
    extra: dict[str, Any] = {}
    for mime, value in bundle.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
            continue
        if (
            field == "text"
            and isinstance(value, str)
            and len(value) >= 2
            and value[0] == value[-1] == "'"
        ):
            value = value[1:-1]
        ev[field] = value
    if extra:
        ev["extra"] = extra
    return ev


def strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)


@dataclass
class Tracker:
    """Follows the iopub messages of one execute request (`msg_id`)."""

    msg_id: str
    busy: bool = False
    done: bool = False
    errored: bool = False

    def feed(self, msg: dict[str, Any]) -> list[Event]:
        """The events one iopub message gives; sets `done` at the request's idle."""
        if (msg.get("parent_header") or {}).get("msg_id") != self.msg_id:
            return []
        kind = (msg.get("header") or {}).get("msg_type") or msg.get("msg_type")
        content = msg.get("content") or {}
        date = (msg.get("header") or {}).get("date")
        stamp = date.isoformat() if isinstance(date, datetime) else (str(date) if date else None)
        if kind == "stream":
            name = content.get("name")
            if name in ("stdout", "stderr") and content.get("text"):
                return [stream(name, content["text"], stamp)]
        elif kind == "execute_input":
            n = content.get("execution_count")
            if isinstance(n, int):
                return [count(n)]
        elif kind in ("display_data", "update_display_data"):
            return [result(dict(content.get("data") or {}), False)]
        elif kind == "execute_result":
            return [result(dict(content.get("data") or {}), True)]
        elif kind == "error":
            if self.errored:
                return []
            self.errored = True
            tb = "\n".join(strip_ansi(str(line)) for line in content.get("traceback") or [])
            return [error(str(content.get("ename", "")), str(content.get("evalue", "")), tb)]
        elif kind == "status":
            state = content.get("execution_state")
            if state == "busy":
                self.busy = True
            elif state == "idle" and self.busy:
                self.done = True
        return []


# --- languages and per-execution environment -------------------------------------------------


def normalize_language(language: str | None) -> str:
    """The context language for a request's `language` (None: python)."""
    lang = (language or "python").strip().lower()
    return _ALIASES.get(lang, lang)


def valid_env_name(name: str) -> bool:
    return bool(_ENV_NAME.match(name))


def check_envs(envs: Any) -> dict[str, str]:
    """A request's `env_vars` (null or a map of names to strings), checked."""
    if envs is None:
        return {}
    if not isinstance(envs, dict):
        raise ValueError("env_vars must be an object")
    out: dict[str, str] = {}
    for k, v in envs.items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            raise ValueError(f"invalid environment variable name {k!r}")
        if not isinstance(v, str) or "\0" in v:
            raise ValueError(f"the value of {k} must be a string without NUL")
        out[k] = v
    return out


def python_env_push(envs: dict[str, str]) -> str:
    """Python that sets `envs` in the kernel and remembers the values it replaces."""
    return (
        "import os as _aenv_os\n"
        f"_aenv_saved_env = {{k: _aenv_os.environ.get(k) for k in {sorted(envs)!r}}}\n"
        f"_aenv_os.environ.update({envs!r})\n"
    )


def python_env_pop() -> str:
    """Python that puts back what `python_env_push` replaced."""
    return (
        "for _aenv_k, _aenv_v in _aenv_saved_env.items():\n"
        "    if _aenv_v is None:\n"
        "        _aenv_os.environ.pop(_aenv_k, None)\n"
        "    else:\n"
        "        _aenv_os.environ[_aenv_k] = _aenv_v\n"
        "del _aenv_saved_env, _aenv_k, _aenv_v\n"
    )


def shell_quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


def bash_script(path: str, envs: dict[str, str], marker: str) -> str:
    """What the persistent bash of a context is sent for one execution: the code (in
    `path`) sourced in the shell itself, so variables, functions and the directory stay,
    with `envs` for that run only, then the marker with the exit status on stdout and the
    marker on stderr (the reader's end of the execution)."""
    lines = []
    names = " ".join(sorted(envs))
    if envs:
        lines.append(f"_aenv_saved=$(declare -p {names} 2>/dev/null)")
        lines.append("export " + " ".join(f"{k}={shell_quote(v)}" for k, v in sorted(envs.items())))
    lines.append(f"source {shell_quote(path)} </dev/null")
    lines.append("_aenv_rc=$?")
    if envs:
        lines.append(f'unset {names}; eval "$_aenv_saved"; unset _aenv_saved')
    lines.append(f"printf '%s %d\\n' {marker} \"$_aenv_rc\"")
    lines.append(f"printf '%s\\n' {marker} >&2")
    return "\n".join(lines) + "\n"
