"""The image-alias table: image references a build's `fromImage` (or a Dockerfile's FROM)
names that stand for a local template, so E2B's stock base images need no registry.

Keys are image references (`e2bdev/base`, `docker.io/e2bdev/base`, `e2bdev/base:1.0`): a key
without tag or digest matches every tag of that repository, one with a tag only that tag.
Values are template names or ids. A key that does not parse never matches (a bad entry in
the table must not break every build)."""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import BadRequest
from ..images.reference import Reference, parse_reference, split_reference


def _parse(text: str) -> tuple[Reference, bool] | None:
    """The reference and whether it names a tag or digest of its own."""
    try:
        _registry, _path, tag, digest = split_reference(text)
        return parse_reference(text), bool(tag or digest)
    except BadRequest:
        return None


def alias_for(image: str, table: Mapping[str, str]) -> str | None:
    """The template `image` stands for, or None. An entry with a tag wins over one without."""
    parsed = _parse(image)
    if parsed is None:
        return None
    ref, _ = parsed
    loose: str | None = None
    for key, template in table.items():
        entry = _parse(key)
        if entry is None or not template:
            continue
        kref, pinned = entry
        if kref.name != ref.name:
            continue
        if not pinned:
            loose = loose or template
        elif (kref.digest and kref.digest == ref.digest) or (
            not kref.digest and kref.tag == ref.tag
        ):
            return template
    return loose
