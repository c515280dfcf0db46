"""Uploaded build contexts: the tar(.gz) of a COPY step's files, stored by the SDK's hash.

`GET /templates/{id}/files/{hash}` answers with an upload URL back at this server (the SDK
PUTs the archive there without the API key), signed with an HMAC of the API key so nobody
else can fill the store: `?expires=<unix s>&signature=<hex>`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import tarfile
import time
import uuid
from pathlib import Path

from ..errors import BadRequest, Forbidden
from ..fsutil import private_dir
from .spec import FILES_HASH_RE

UPLOAD_TTL = 3600.0
MAX_UPLOAD = 8 << 30  # a sanity bound on one build context


class BuildFiles:
    def __init__(self, root: Path, secret: str) -> None:
        self.root = root
        self._secret = secret.encode()

    def path(self, files_hash: str) -> Path:
        if not FILES_HASH_RE.match(files_hash):
            raise BadRequest(f"invalid files hash {files_hash!r}")
        return self.root / files_hash

    def present(self, files_hash: str) -> bool:
        return self.path(files_hash).is_file()

    # --- signed upload URLs ---
    def _mac(self, files_hash: str, expires: int) -> str:
        msg = f"build-files:{files_hash}:{expires}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def sign(self, files_hash: str, now: float | None = None) -> dict[str, str]:
        expires = int((now or time.time()) + UPLOAD_TTL)
        return {"expires": str(expires), "signature": self._mac(files_hash, expires)}

    def check(self, files_hash: str, expires: str | None, signature: str | None) -> None:
        if not expires or not signature or not expires.isdigit():
            raise Forbidden("upload URL is not signed")
        if int(expires) < time.time():
            raise Forbidden("upload URL expired; ask for a new one")
        if not hmac.compare_digest(self._mac(files_hash, int(expires)), signature):
            raise Forbidden("upload URL signature is invalid")

    # --- storing ---
    def staging(self) -> Path:
        private_dir(self.root)  # users' build contexts: for root alone
        return self.root / f".upload-{uuid.uuid4().hex}"

    def commit(self, staged: Path, files_hash: str) -> None:
        """Checks that `staged` is a readable tar (plain or compressed) and moves it in."""
        target = self.path(files_hash)
        try:
            with tarfile.open(staged, "r:*") as tf:
                for _ in tf:
                    pass
        except (tarfile.TarError, OSError, EOFError) as e:
            with contextlib.suppress(FileNotFoundError):
                staged.unlink()
            raise BadRequest(f"the uploaded files are not a tar archive: {e}") from None
        os.replace(staged, target)

    def discard(self, staged: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            staged.unlink()
