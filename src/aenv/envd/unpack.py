"""`POST /tree` (the node's apply, docs/fork-tree.md): a tar of files to put into the sandbox,
its first member (`DELETE_MEMBER`, optional) the JSON list of paths to remove first. Owners,
modes and times are kept (envd is root). Spooled, then unpacked off the event loop.

Stdlib only, like the rest of envd."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tarfile
import tempfile
from typing import IO, Any

# The member that lists what to delete; never written as a file.
DELETE_MEMBER = ".aenv-apply/delete.json"
_SPOOL = 8 << 20
_CHUNK = 1 << 20


def _delete(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def unpack_file(f: IO[bytes], root: str = "/") -> dict[str, int]:
    """Deletes what the delete member lists, then extracts the rest under `root`."""
    deleted = extracted = 0
    with tarfile.open(fileobj=f, mode="r:") as tar:
        for member in tar:
            if member.name == DELETE_MEMBER:
                src = tar.extractfile(member)
                paths = json.loads(src.read()) if src is not None else []
                for p in paths:
                    _delete(os.path.join(root, str(p).lstrip("/")))
                deleted += len(paths)
                continue
            tar.extract(member, root, numeric_owner=True)
            extracted += 1
    return {"deleted": deleted, "extracted": extracted}


async def unpack(body: Any) -> dict[str, int]:
    """The request body (`.read(n)`, async) spooled and unpacked at /."""
    with tempfile.SpooledTemporaryFile(_SPOOL) as spool:
        while data := await body.read(_CHUNK):
            spool.write(data)
        spool.seek(0)
        return await asyncio.to_thread(unpack_file, spool)
