"""A Dockerfile, as the E2B build request the builder runs (what `aenv build` sends).

Supported: one stage (`FROM image [AS name]`, ARGs before it for the FROM line), RUN (shell,
exec and heredoc forms; `--mount`/`--network` flags are dropped with a warning), ENV, ARG
(defaults, overridden by `--build-arg`; during RUN they are exported like docker does), WORKDIR,
USER, COPY/ADD of local files (`--chown`, `--chmod`; several sources into a directory),
SHELL (wraps later RUN commands), ENTRYPOINT/CMD (the container's command: the start command
when asked for), and EXPOSE, LABEL, VOLUME, STOPSIGNAL, HEALTHCHECK, MAINTAINER as metadata.
Variables (`$V`, `${V}`, `${V:-default}`, `${V:+alt}`) are expanded where docker expands them.
Refused with a clear error: several stages, `COPY --from`, `ADD <url>`, `FROM scratch`,
ONBUILD.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import BadRequest


class DockerfileError(BadRequest):
    """The Dockerfile cannot be turned into a build (the message names the line)."""


@dataclass
class CopyStep:
    """A COPY/ADD source: its files are tarred from the context and uploaded by hash."""

    index: int  # position in `steps`
    src: str
    dest: str
    owner: str
    mode: str


@dataclass
class Dockerfile:
    from_image: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    copies: list[CopyStep] = field(default_factory=list)
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def command(self) -> list[str]:
        """The container's command line: ENTRYPOINT + CMD (CMD only with an exec-form or no
        ENTRYPOINT, as docker has it)."""
        ep = self.entrypoint or []
        if ep[:2] == ["/bin/sh", "-c"]:
            return list(ep)
        return [*ep, *(self.cmd or [])]

    def start_cmd(self) -> str | None:
        argv = self.command
        if not argv:
            return None
        if argv[:2] == ["/bin/sh", "-c"] and len(argv) == 3:
            return argv[2]
        return shlex.join(argv)


# --------------------------------------------------------------------------------------------
# lines


@dataclass
class _Instruction:
    line: int
    keyword: str
    rest: str
    heredocs: list[tuple[str, str]] = field(default_factory=list)  # (delimiter, body)


_DIRECTIVE = re.compile(r"^#\s*([a-zA-Z]+)\s*=\s*(\S+)\s*$")
_HEREDOC = re.compile(r"<<(-?)(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\2")


def _instructions(text: str) -> list[_Instruction]:
    lines = text.splitlines()
    escape = "\\"
    i = 0
    # Parser directives: only at the very top, before anything else.
    while i < len(lines):
        m = _DIRECTIVE.match(lines[i].strip())
        if not m:
            break
        if m.group(1).lower() == "escape":
            if m.group(2) not in ("\\", "`"):
                raise DockerfileError(f"line {i + 1}: escape must be \\ or `")
            escape = m.group(2)
        i += 1
    out: list[_Instruction] = []
    while i < len(lines):
        raw = lines[i]
        start = i
        i += 1
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        parts = [raw.rstrip()]
        while parts[-1].endswith(escape) and i <= len(lines):
            parts[-1] = parts[-1][: -len(escape)]
            # Comment and blank lines inside a continuation are skipped.
            while i < len(lines) and (not lines[i].strip() or lines[i].strip().startswith("#")):
                i += 1
            if i >= len(lines):
                break
            parts.append(lines[i].rstrip())
            i += 1
        joined = " ".join(p.strip() for p in parts if p.strip())
        keyword, _, rest = joined.strip().partition(" ")
        ins = _Instruction(start + 1, keyword.upper(), rest.strip())
        if ins.keyword in ("RUN", "COPY", "ADD"):
            for m in _HEREDOC.finditer(ins.rest):
                strip_tabs, delim = m.group(1) == "-", m.group(3)
                body: list[str] = []
                while i < len(lines) and lines[i].rstrip("\n") != delim:
                    line = lines[i]
                    body.append(line.lstrip("\t") if strip_tabs else line)
                    i += 1
                if i >= len(lines):
                    raise DockerfileError(f"line {ins.line}: heredoc {delim} is not terminated")
                i += 1
                ins.heredocs.append((delim, "\n".join(body) + "\n"))
        out.append(ins)
    return out


# --------------------------------------------------------------------------------------------
# words and variables


def expand(text: str, env: Mapping[str, str], line: int = 0) -> str:
    """Docker's variable substitution outside single quotes (`\\$` is a literal `$`)."""
    out: list[str] = []
    i = 0
    quote: str | None = None
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] == "$":
            out.append("\\$" if quote == "'" else "$")
            i += 2
            continue
        if c in "'\"":
            if quote is None:
                quote = c
            elif quote == c:
                quote = None
            out.append(c)
            i += 1
            continue
        if c == "$" and quote != "'":
            value, i = _variable(text, i, env, line)
            out.append(value)
            continue
        out.append(c)
        i += 1
    return "".join(out)


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _variable(text: str, i: int, env: Mapping[str, str], line: int) -> tuple[str, int]:
    if i + 1 < len(text) and text[i + 1] == "{":
        end = text.find("}", i + 2)
        if end < 0:
            raise DockerfileError(f"line {line}: missing }} in {text!r}")
        inner = text[i + 2 : end]
        m = _NAME.match(inner)
        if not m:
            raise DockerfileError(f"line {line}: bad substitution ${{{inner}}}")
        name, op = m.group(0), inner[m.end() :]
        value = env.get(name)
        if op.startswith(":-"):
            return (value if value else expand(op[2:], env, line)), end + 1
        if op.startswith(":+"):
            return (expand(op[2:], env, line) if value else ""), end + 1
        if op.startswith("-"):
            return (value if value is not None else expand(op[1:], env, line)), end + 1
        if op.startswith("+"):
            return (expand(op[1:], env, line) if value is not None else ""), end + 1
        if op:
            raise DockerfileError(f"line {line}: unsupported substitution ${{{inner}}}")
        return value or "", end + 1
    m = _NAME.match(text, i + 1)
    if not m:
        return "$", i + 1
    return env.get(m.group(0), ""), m.end()


def _words(text: str, line: int) -> list[str]:
    try:
        return shlex.split(text, comments=False, posix=True)
    except ValueError as e:
        raise DockerfileError(f"line {line}: {e}") from None


def _json_list(text: str) -> list[str] | None:
    """The exec (JSON array) form, or None for the shell form."""
    t = text.strip()
    if not t.startswith("["):
        return None
    try:
        value = json.loads(t)
    except ValueError:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return None
    return value


def _flags(rest: str, line: int) -> tuple[dict[str, str], str]:
    """Leading `--name=value` flags of an instruction."""
    flags: dict[str, str] = {}
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        name, _, value = word[2:].partition("=")
        if not name:
            raise DockerfileError(f"line {line}: bad flag {word!r}")
        flags[name.lower()] = value
        rest = rest.lstrip()
    return flags, rest


def _key_values(text: str, line: int, keyword: str) -> list[tuple[str, str]]:
    """`k=v k2="v 2"` or the legacy `k v with spaces` form (ENV, LABEL)."""
    words = _words(text, line)
    if not words:
        raise DockerfileError(f"line {line}: {keyword} needs arguments")
    if "=" not in words[0]:
        key, _, value = text.strip().partition(" ")
        if not value.strip():
            raise DockerfileError(f"line {line}: {keyword} {key} needs a value")
        joined = _words(value, line)
        return [(key, " ".join(joined))]
    pairs = []
    for w in words:
        key, sep, value = w.partition("=")
        if not sep or not key:
            raise DockerfileError(f"line {line}: {keyword} expects key=value, got {w!r}")
        pairs.append((key, value))
    return pairs


# --------------------------------------------------------------------------------------------
# the parser


def parse_dockerfile(text: str, build_args: Mapping[str, str] | None = None) -> Dockerfile:
    build_args = dict(build_args or {})
    used_args: set[str] = set()
    global_args: dict[str, str | None] = {}
    stage_args: dict[str, str | None] = {}
    env: dict[str, str] = {}
    workdir: str | None = None
    shell: list[str] | None = None
    df: Dockerfile | None = None

    def arg_value(name: str, default: str | None) -> str | None:
        if name in build_args:
            used_args.add(name)
            return build_args[name]
        return default

    def variables() -> dict[str, str]:
        out = {k: v for k, v in stage_args.items() if v is not None}
        out.update(env)
        return out

    for ins in _instructions(text):
        kw, rest, line = ins.keyword, ins.rest, ins.line
        if kw == "ARG":
            for word in _words(rest, line):
                name, sep, default = word.partition("=")
                if not _NAME.fullmatch(name):
                    raise DockerfileError(f"line {line}: invalid ARG name {name!r}")
                if df is None:
                    globals_env = {k: v for k, v in global_args.items() if v is not None}
                    value = default if sep else None
                    if value is not None:
                        value = expand(value, globals_env, line)
                    global_args[name] = arg_value(name, value)
                else:
                    value = expand(default, variables(), line) if sep else global_args.get(name)
                    stage_args[name] = arg_value(name, value)
            continue
        if kw == "FROM":
            if df is not None:
                raise DockerfileError(
                    f"line {line}: multi-stage Dockerfiles are not supported (second FROM)"
                )
            flags, rest = _flags(rest, line)
            globals_env = {k: v for k, v in global_args.items() if v is not None}
            words = _words(expand(rest, globals_env, line), line)
            if (
                not words
                or (len(words) not in (1, 3))
                or (len(words) == 3 and words[1].upper() != "AS")
            ):
                raise DockerfileError(f"line {line}: FROM takes an image [AS name]")
            if words[0] == "scratch":
                raise DockerfileError(f"line {line}: FROM scratch is not supported (no shell)")
            df = Dockerfile(from_image=words[0])
            if flags.get("platform"):
                df.warnings.append(f"line {line}: --platform ignored (the node's platform is used)")
            continue
        if df is None:
            raise DockerfileError(f"line {line}: {kw} before FROM")
        if kw == "RUN":
            flags, rest = _flags(rest, line)
            for name in flags:
                df.warnings.append(f"line {line}: RUN --{name} is not supported; ignored")
            if ins.heredocs:
                command = "".join(body for _, body in ins.heredocs)
                head = _HEREDOC.sub("", rest).strip()
                if head and head not in ("bash", "sh", "/bin/sh", "/bin/bash"):
                    command = f"{head} <<'AENV_EOF'\n{command}AENV_EOF"
                elif head:
                    command = f"{head} -c {shlex.quote(command)}"
            else:
                exec_form = _json_list(rest)
                command = shlex.join(exec_form) if exec_form is not None else rest
                if exec_form is None and shell:
                    command = shlex.join([*shell, command])
            exports = {k: v for k, v in stage_args.items() if v is not None and k not in env}
            if exports:
                prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in exports.items())
                command = f"export {prefix}; {command}"
            df.steps.append({"type": "RUN", "args": [command], "force": False})
        elif kw == "ENV":
            pairs = _key_values(expand(rest, variables(), line), line, "ENV")
            args: list[str] = []
            for key, value in pairs:
                env[key] = value
                args += [key, value]
            df.steps.append({"type": "ENV", "args": args, "force": False})
        elif kw == "WORKDIR":
            path = " ".join(_words(expand(rest, variables(), line), line))
            if not path:
                raise DockerfileError(f"line {line}: WORKDIR needs a path")
            workdir = posixpath.normpath(
                path if path.startswith("/") else posixpath.join(workdir or "/", path)
            )
            df.steps.append({"type": "WORKDIR", "args": [workdir], "force": False})
        elif kw == "USER":
            user = expand(rest.strip(), variables(), line)
            if not user:
                raise DockerfileError(f"line {line}: USER needs a user")
            df.steps.append({"type": "USER", "args": [user], "force": False})
        elif kw in ("COPY", "ADD"):
            _copy(df, ins, variables(), workdir)
        elif kw in ("CMD", "ENTRYPOINT"):
            exec_form = _json_list(rest)
            argv = exec_form if exec_form is not None else [*(shell or ["/bin/sh", "-c"]), rest]
            if kw == "CMD":
                df.cmd = argv
            else:
                df.entrypoint = argv
                if exec_form is None:
                    df.cmd = None
        elif kw == "SHELL":
            shell_form = _json_list(rest)
            if not shell_form:
                raise DockerfileError(f"line {line}: SHELL takes a JSON array")
            shell = shell_form
        elif kw == "EXPOSE":
            ports = _words(expand(rest, variables(), line), line)
            df.metadata.setdefault("expose", []).extend(ports)
        elif kw == "LABEL":
            labels = df.metadata.setdefault("labels", {})
            for key, value in _key_values(expand(rest, variables(), line), line, "LABEL"):
                labels[key] = value
        elif kw == "VOLUME":
            vol_list = _json_list(rest)
            vols = (
                vol_list if vol_list is not None else _words(expand(rest, variables(), line), line)
            )
            df.metadata.setdefault("volumes", []).extend(vols)
        elif kw == "STOPSIGNAL":
            df.metadata["stopsignal"] = expand(rest.strip(), variables(), line)
        elif kw == "HEALTHCHECK":
            df.metadata["healthcheck"] = rest
        elif kw == "MAINTAINER":
            df.metadata.setdefault("labels", {})["maintainer"] = rest
        elif kw == "ONBUILD":
            raise DockerfileError(f"line {line}: ONBUILD is not supported")
        else:
            raise DockerfileError(f"line {line}: unknown instruction {kw}")
    if df is None:
        raise DockerfileError("the Dockerfile has no FROM")
    unused = sorted(set(build_args) - used_args)
    if unused:
        df.warnings.append(f"build args not used by the Dockerfile: {', '.join(unused)}")
    return df


def _copy(
    df: Dockerfile, ins: _Instruction, variables: dict[str, str], workdir: str | None
) -> None:
    line = ins.line
    flags, rest = _flags(ins.rest, line)
    if "from" in flags:
        raise DockerfileError(f"line {line}: COPY --from (multi-stage) is not supported")
    for name in flags:
        if name not in ("chown", "chmod", "link"):
            raise DockerfileError(f"line {line}: {ins.keyword} --{name} is not supported")
    if ins.heredocs:
        raise DockerfileError(f"line {line}: {ins.keyword} with a heredoc is not supported")
    exec_form = _json_list(rest)
    if exec_form is not None:
        words = [expand(w, variables, line) for w in exec_form]
    else:
        words = _words(expand(rest, variables, line), line)
    if len(words) < 2:
        raise DockerfileError(f"line {line}: {ins.keyword} needs a source and a destination")
    *sources, dest = words
    trailing = dest.endswith("/") or dest in (".", "..") or dest.endswith(("/.", "/.."))
    dest = posixpath.normpath(posixpath.join(workdir or "/", dest))
    if trailing and dest != "/":
        dest += "/"
    if len(sources) > 1 and not dest.endswith("/"):
        raise DockerfileError(f"line {line}: with several sources the destination must end with /")
    owner = expand(flags.get("chown", ""), variables, line)
    mode = flags.get("chmod", "")
    if mode and not re.fullmatch(r"0?[0-7]{3,4}", mode):
        raise DockerfileError(f"line {line}: --chmod takes an octal mode")
    for src in sources:
        if re.match(r"^[a-z]+://", src) or src.startswith("git@"):
            raise DockerfileError(
                f"line {line}: {ins.keyword} of a URL is not supported; use RUN curl/wget"
            )
        norm = posixpath.normpath(src)
        if norm.startswith("/") or norm == ".." or norm.startswith("../"):
            raise DockerfileError(f"line {line}: {src!r} is outside the build context")
        if ins.keyword == "ADD" and re.search(r"\.(tar|tgz|tar\.\w+)$", norm):
            df.warnings.append(
                f"line {line}: ADD does not unpack local archives here ({src} is copied as is)"
            )
        df.copies.append(CopyStep(len(df.steps), norm, dest, owner or "root", mode))
        df.steps.append(
            {"type": "COPY", "args": [norm, dest, owner or "root", mode], "force": False}
        )
