"""The build request as E2B's SDK sends it (`TemplateBuildStartV2`), validated, and the cache key.

A build starts from an image (`fromImage`, optionally with `fromImageRegistry` credentials)
or from another template (`fromTemplate`), runs `steps` in order and ends either as a plain
layer stack (cold boot) or, with `startCmd`, as a memory snapshot taken once `readyCmd`
succeeds.

Steps (`args` by type):
    RUN      [cmd] or [cmd, user]
    ENV      [k1, v1, k2, v2, ...]
    WORKDIR  [dir]
    USER     [user]
    COPY     [src, dest, user|"", mode|""], files from the upload named by `filesHash`
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import BadRequest

STEP_TYPES = ("RUN", "ENV", "WORKDIR", "USER", "COPY")
# Steps that change files (a layer each); the others only change the build state.
LAYER_STEPS = ("RUN", "COPY")
FILES_HASH_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_MODE_RE = re.compile(r"^0?[0-7]{3,4}$")


@dataclass(frozen=True)
class Step:
    type: str
    args: list[str]
    force: bool = False
    files_hash: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "args": list(self.args), "force": self.force}
        if self.files_hash:
            out["filesHash"] = self.files_hash
        return out

    def describe(self) -> str:
        """`RUN "cmd"`, `COPY a /b`, `ENV A=1 B=2`, ... for logs and errors."""
        if self.type == "RUN":
            text = f'RUN "{self.args[0]}"'
            return text + (f" (as {self.args[1]})" if len(self.args) > 1 and self.args[1] else "")
        if self.type == "ENV":
            pairs = zip(self.args[0::2], self.args[1::2], strict=False)
            return "ENV " + " ".join(f"{k}={v}" for k, v in pairs)
        if self.type == "COPY":
            return f"COPY {self.args[0]} {self.args[1]}"
        return f"{self.type} {self.args[0]}"


@dataclass(frozen=True)
class BuildSpec:
    from_image: str | None = None
    from_template: str | None = None
    registry: dict[str, Any] | None = None  # fromImageRegistry (credentials)
    force: bool = False
    steps: list[Step] = field(default_factory=list)
    start_cmd: str | None = None
    ready_cmd: str | None = None
    # aenv extension (`aenv build`): what a Dockerfile says beyond the steps (ENTRYPOINT/CMD,
    # EXPOSE, LABEL, VOLUME, ...), kept in the template doc.
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """What is kept with the build record (credentials left out)."""
        out: dict[str, Any] = {
            "fromImage": self.from_image,
            "fromTemplate": self.from_template,
            "force": self.force,
            "steps": [s.to_json() for s in self.steps],
            "startCmd": self.start_cmd,
            "readyCmd": self.ready_cmd,
            "metadata": self.metadata or None,
        }
        if self.registry:
            out["fromImageRegistry"] = {"type": self.registry.get("type")}
        return {k: v for k, v in out.items() if v is not None}


def _strings(value: Any, what: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"{what} must be a list of strings")
    return list(value)


def parse_step(raw: dict[str, Any], n: int) -> Step:
    kind = str(raw.get("type") or "").upper()
    if kind not in STEP_TYPES:
        raise BadRequest(
            f"step {n}: unsupported type {raw.get('type')!r} (supported: {', '.join(STEP_TYPES)})"
        )
    args = _strings(raw.get("args"), f"step {n} args")
    files_hash = raw.get("filesHash") or None
    if kind == "RUN":
        if not 1 <= len(args) <= 2 or not args[0].strip():
            raise BadRequest(f"step {n}: RUN takes [cmd] or [cmd, user]")
    elif kind == "ENV":
        if not args or len(args) % 2:
            raise BadRequest(f"step {n}: ENV takes [key, value, ...] pairs")
        for key in args[0::2]:
            if not key or "=" in key or "\0" in key:
                raise BadRequest(f"step {n}: invalid environment variable name {key!r}")
    elif kind in ("WORKDIR", "USER"):
        if len(args) != 1 or not args[0].strip():
            raise BadRequest(f"step {n}: {kind} takes one argument")
    elif kind == "COPY":
        while len(args) < 4:
            args.append("")
        if len(args) != 4 or not args[0] or not args[1]:
            raise BadRequest(f"step {n}: COPY takes [src, dest, user, mode]")
        if args[3] and not _MODE_RE.match(args[3]):
            raise BadRequest(f"step {n}: COPY mode {args[3]!r} is not an octal mode")
        if not isinstance(files_hash, str) or not FILES_HASH_RE.match(files_hash):
            raise BadRequest(f"step {n}: COPY needs the filesHash of its uploaded files")
        src = posixpath.normpath(args[0])
        if src.startswith("/") or src == ".." or src.startswith("../"):
            raise BadRequest(f"step {n}: COPY source {args[0]!r} is outside the context")
    return Step(
        type=kind,
        args=args,
        force=bool(raw.get("force")),
        files_hash=files_hash if kind == "COPY" else None,
    )


def parse_spec(raw: dict[str, Any]) -> BuildSpec:
    from_image = raw.get("fromImage") or None
    from_template = raw.get("fromTemplate") or None
    if from_image and from_template:
        raise BadRequest("give either fromImage or fromTemplate, not both")
    if not from_image and not from_template:
        raise BadRequest("a build needs fromImage or fromTemplate")
    registry = raw.get("fromImageRegistry") or None
    if registry is not None and not isinstance(registry, dict):
        raise BadRequest("fromImageRegistry must be an object")
    steps_raw = raw.get("steps") or []
    if not isinstance(steps_raw, list) or not all(isinstance(s, dict) for s in steps_raw):
        raise BadRequest("steps must be a list of objects")
    start = raw.get("startCmd") or None
    ready = raw.get("readyCmd") or None
    for what, value in (("startCmd", start), ("readyCmd", ready)):
        if value is not None and not isinstance(value, str):
            raise BadRequest(f"{what} must be a string")
    metadata = raw.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise BadRequest("metadata must be an object")
    return BuildSpec(
        from_image=str(from_image) if from_image else None,
        from_template=str(from_template) if from_template else None,
        registry=registry,
        force=bool(raw.get("force")),
        steps=[parse_step(s, i + 1) for i, s in enumerate(steps_raw)],
        start_cmd=start,
        ready_cmd=ready,
        metadata=metadata,
    )


@dataclass
class BuildState:
    """What ENV/WORKDIR/USER set: applies to later steps and lands in the template doc."""

    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None  # as written (name or uid); None: the image's default
    workdir: str | None = None

    def copy(self) -> BuildState:
        return BuildState(dict(self.env), self.user, self.workdir)

    def to_json(self) -> dict[str, Any]:
        return {"env": dict(sorted(self.env.items())), "user": self.user, "workdir": self.workdir}


def apply_state_step(state: BuildState, step: Step) -> None:
    if step.type == "ENV":
        for key, value in zip(step.args[0::2], step.args[1::2], strict=True):
            state.env[key] = expand_env(value, state.env)
    elif step.type == "WORKDIR":
        state.workdir = resolve_dir(step.args[0], state.workdir)
    elif step.type == "USER":
        state.user = step.args[0].strip()


def resolve_dir(path: str, current: str | None) -> str:
    if not path.startswith("/"):
        path = posixpath.join(current or "/", path)
    return posixpath.normpath(path) if path != "/" else "/"


_VAR_RE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def expand_env(value: str, env: dict[str, str]) -> str:
    """`$VAR` / `${VAR}` from the build env (as E2B's ENV does for `PATH=$PATH:/x`)."""
    return _VAR_RE.sub(lambda m: env.get(m.group(1) or m.group(2), ""), value)


def cache_key(parent: list[str], step: Step, state: BuildState) -> str:
    """The step cache key: the layers it runs on, the step itself (its files included by
    hash) and the build state it sees. Equal keys give equal results, barring side effects
    of the outside world (RUN curl ...), which `force` is for."""
    doc = {
        "v": 1,
        "parent": list(parent),
        "step": {"type": step.type, "args": step.args, "files": step.files_hash},
        "state": state.to_json(),
    }
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()
