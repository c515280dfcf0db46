"""A template's record (a template, snapshot or hibernation), and its JSON document as the
catalog and the repository store it."""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .basics import BootInfo, VolumeMount
from .sandbox import SandboxRecord, record_from_json, record_to_json


class TemplateKind(enum.StrEnum):
    IMAGE = "image"  # an OCI image or the built-in base, booted cold
    TEMPLATE = "template"  # a finished template build
    SNAPSHOT = "snapshot"  # files + memory + processes of a sandbox
    HIBERNATION = "hibernation"  # a hibernated sandbox, in the repository only
    BUILD_STEP = "build-step"  # a build's transient stack


@dataclass
class BuildInfo:
    """What a template's build recorded on it: the build, the commands its sandboxes start
    with, where it started from, and for a built-in template the recipe it was made by."""

    build_id: str | None = None
    name: str | None = None
    status: str | None = None
    start_cmd: str | None = None
    ready_cmd: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    from_template: str | None = None
    from_image: str | None = None
    # What `from_image` resolved to.
    image: str | None = None
    image_digest: str | None = None
    # A built-in template's: how it was made, from which recipe, how large its rootfs is.
    source: str | None = None
    recipe_hash: str | None = None
    size: int | None = None
    # The code interpreter's rootfs layers it was built on (`builds/code_interpreter.py`).
    rootfs_stamp: str | None = None

    @property
    def origin(self) -> str | None:
        """The template or image the build started from."""
        return self.from_template or self.from_image


# The keys of the template document that hold BuildInfo's fields (the document kept these
# flat since before they were typed; older documents load alike): each field's own name,
# except these.
_RENAMED = {
    "status": "build_status",
    "from_template": "fromTemplate",
    "from_image": "fromImage",
    "image_digest": "digest",
    "rootfs_stamp": "aenv-rootfs",
}
_BUILD_KEYS = {f.name: _RENAMED.get(f.name, f.name) for f in fields(BuildInfo)}
# The document keys of a fork's marker, a pin's template and a hibernated sandbox's record.
FORK_OF_KEY, PINNED_OF_KEY, SANDBOX_RECORD_KEY = "fork_of", "pinned_of", "sandbox_record"


def _build_doc(b: BuildInfo) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, key in _BUILD_KEYS.items():
        value = getattr(b, name)
        if value is not None and value != {}:
            out[key] = value
    return out


def _build_of(doc: dict[str, Any]) -> BuildInfo:
    found: dict[str, Any] = {}
    for name, key in _BUILD_KEYS.items():
        value = doc.get(key)
        if value is None:
            continue
        if name == "metadata":
            value = {str(k): str(v) for k, v in dict(value).items()}
        elif name == "size":
            value = int(value)
        elif name == "image" and isinstance(value, dict):  # a cold start's, before typing
            value = value.get("reference")
        else:
            value = str(value)
        found[name] = value
    return BuildInfo(**found)


# The fields of a template document that are TemplateRecord's own fields of the same name.
_TEMPLATE_FIELDS = (
    "kind",
    "layers",
    "internal",
    "checkpoint",
    "env",
    "user",
    "workdir",
    "cpu_count",
    "memory_mb",
    "created_at",
    "parent",
    "sandbox_id",
    "envd_token",
    "env_vars",
    "boot_of",
    "boot_from_layers",
    "boot_run",
    "published",
    "volume_mounts",
    "standby_after",
)


@dataclass
class TemplateRecord:
    """A template, snapshot or hibernation: a layer stack (topmost first), optionally a
    memory image, and what a sandbox booted from it inherits."""

    template_id: str
    kind: TemplateKind
    layers: list[str]
    names: list[str] = field(default_factory=list)
    # Not shown to users (build steps, boot snapshots, fork snapshots).
    internal: bool = False
    # The name of its memory image; None for a template booted cold.
    checkpoint: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    workdir: str | None = None
    cpu_count: int | None = None
    memory_mb: int | None = None
    created_at: str | None = None
    # The template a snapshot's sandbox was created from.
    parent: str | None = None
    # The sandbox a snapshot was taken of.
    sandbox_id: str | None = None
    # The access token the snapshotted envd holds (it authorises its re-initialisation).
    envd_token: str = ""
    env_vars: dict[str, str] = field(default_factory=dict)
    # A boot snapshot: of which template, over which of its layers, made by which node run.
    boot_of: str | None = None
    boot_from_layers: list[str] | None = None
    boot_run: str | None = None
    # In the durable repository.
    published: bool = False
    build: BuildInfo = field(default_factory=BuildInfo)
    # A fork's own snapshot: the sandbox forked (no one else ever sees it).
    fork_of: str | None = None
    # A tag's pinned copy: the template it pins a build of (`builds/tags.py`).
    pinned_of: str | None = None
    # A hibernation's sandbox, so another node can take it over (tokens and all: the
    # repository is as private as the catalog).
    hibernated: SandboxRecord | None = None
    # A snapshot's volumes (not their content): what sandboxes restored from it mount.
    volume_mounts: list[VolumeMount] = field(default_factory=list)
    # Seconds idle before standby for its sandboxes that set none (None: the node's).
    standby_after: float | None = None

    @property
    def has_memory(self) -> bool:
        return self.checkpoint is not None

    def boot_info(self) -> BootInfo:
        """What a sandbox booted from it inherits."""
        return BootInfo(
            env=dict(self.env), user=self.user, workdir=self.workdir, from_layers=list(self.layers)
        )

    def to_doc(self) -> dict[str, Any]:
        """The JSON document the catalog and the repository store (names kept apart)."""
        doc = _build_doc(self.build)
        for name in _TEMPLATE_FIELDS:
            value = getattr(self, name)
            if name == "volume_mounts":
                value = [asdict(m) for m in value]
            doc[name] = value.value if isinstance(value, enum.Enum) else value
        for key, value in ((FORK_OF_KEY, self.fork_of), (PINNED_OF_KEY, self.pinned_of)):
            if value is not None:
                doc[key] = value
        if self.hibernated is not None:
            doc[SANDBOX_RECORD_KEY] = json.loads(record_to_json(self.hibernated))
        return doc

    @classmethod
    def from_doc(
        cls, template_id: str, doc: dict[str, Any], names: list[str] | None = None
    ) -> TemplateRecord:
        known = {k: doc[k] for k in _TEMPLATE_FIELDS if k in doc}
        kind = known.pop("kind", None) or TemplateKind.TEMPLATE
        for key in ("env", "env_vars"):
            known[key] = dict(known.get(key) or {})
        for key in ("cpu_count", "memory_mb"):
            if known.get(key) is not None:
                known[key] = int(known[key])
        known["layers"] = list(known.get("layers") or [])
        known["internal"] = bool(known.get("internal"))
        known["published"] = bool(known.get("published"))
        known["envd_token"] = known.get("envd_token") or ""
        known["volume_mounts"] = [VolumeMount(**m) for m in known.get("volume_mounts") or []]
        if known.get("checkpoint") is not None:
            known["checkpoint"] = str(known["checkpoint"])
        return cls(
            template_id=template_id,
            kind=TemplateKind(kind),
            names=list(names or []),
            build=_build_of(doc),
            fork_of=_str_or_none(doc.get(FORK_OF_KEY)),
            pinned_of=_str_or_none(doc.get(PINNED_OF_KEY)),
            hibernated=_sandbox_of(doc.get(SANDBOX_RECORD_KEY)),
            **known,
        )


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def _sandbox_of(value: object) -> SandboxRecord | None:
    return record_from_json(json.dumps(value)) if isinstance(value, dict) else None
