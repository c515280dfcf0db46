"""A repository in an S3-compatible bucket (AWS S3, MinIO, Ceph RGW, R2, moto...), through
obstore (Rust object_store: multipart uploads straight from the file, streamed downloads).

Every PUT is atomic on S3 (a multipart upload becomes visible only when completed), so no
reader ever sees a partial object. Large files are uploaded in `part_size` parts with at
most `concurrency` in flight, and downloaded as a stream of chunks written to disk as they
arrive: memory stays around part_size × concurrency whatever the object's size.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import obstore
from obstore.exceptions import BaseError as ObstoreError
from obstore.store import S3Store

from ..errors import ObjectNotFound, RepositoryError
from .base import CHUNK, HashingFileWriter, ObjectInfo, Repository, check_key, norm_prefix

_DELETE_BATCH = 1000


@dataclass(frozen=True)
class S3Credentials:
    access_key_id: str
    secret_access_key: str
    session_token: str | None = None

    def __repr__(self) -> str:  # never print the secret
        return f"S3Credentials(access_key_id={self.access_key_id!r}, secret_access_key='***')"


class S3Repository(Repository):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str | None = None,
        credentials: S3Credentials | None = None,
        part_size: int = 8 * 1024 * 1024,
        concurrency: int = 4,
        timeout_seconds: float = 3600.0,
    ) -> None:
        self.bucket = bucket
        self.prefix = norm_prefix(prefix)
        self.endpoint = endpoint
        self.part_size = max(int(part_size), 5 * 1024 * 1024)  # S3's minimum part size
        self.concurrency = max(1, int(concurrency))
        where = f" at {endpoint}" if endpoint else ""
        self.url = f"s3://{bucket}/{self.prefix}{where}"
        config: dict[str, Any] = {"region": region or "us-east-1"}
        if endpoint:
            config["endpoint"] = endpoint
            config["virtual_hosted_style_request"] = False
        if credentials is not None:
            config["access_key_id"] = credentials.access_key_id
            config["secret_access_key"] = credentials.secret_access_key
            if credentials.session_token:
                config["session_token"] = credentials.session_token
        client: dict[str, Any] = {
            "timeout": f"{int(timeout_seconds)}s",
            "connect_timeout": "10s",
        }
        if endpoint and endpoint.startswith("http://"):
            client["allow_http"] = True
        try:
            self._store = S3Store(
                bucket,
                prefix=self.prefix or None,
                config=config,  # type: ignore[arg-type]
                client_options=client,  # type: ignore[arg-type]
            )
        except (ObstoreError, ValueError) as e:
            raise RepositoryError(f"cannot configure {self.url}: {_first_line(e)}") from e

    def _error(self, op: str, key: str, e: BaseException) -> RepositoryError:
        msg = str(e)
        if "NoSuchBucket" in msg:
            return RepositoryError(f"bucket {self.bucket!r} does not exist{_at(self.endpoint)}")
        return RepositoryError(f"cannot {op} {key!r} in {self.url}: {_first_line(e)}")

    async def put_file(self, key: str, path: Path, *, move: bool = False) -> None:
        check_key(key)
        path = Path(path)
        try:
            await obstore.put_async(
                self._store,
                key,
                path,
                chunk_size=self.part_size,
                max_concurrency=self.concurrency,
            )
        except FileNotFoundError as e:
            if not path.exists():
                raise RepositoryError(f"cannot store {key!r}: {path} does not exist") from e
            raise self._error("store", key, e) from e
        except (ObstoreError, OSError) as e:
            raise self._error("store", key, e) from e
        if move:
            path.unlink(missing_ok=True)

    async def get_file(
        self, key: str, dest: Path, *, sha256: str | None = None, size: int | None = None
    ) -> str:
        check_key(key)
        try:
            resp = await obstore.get_async(self._store, key)
        except FileNotFoundError as e:
            if "NoSuchBucket" in str(e):
                raise self._error("read", key, e) from e
            raise ObjectNotFound(key, f"in {self.url}") from None
        except (ObstoreError, OSError) as e:
            raise self._error("read", key, e) from e
        w = await asyncio.to_thread(HashingFileWriter, Path(dest))
        try:
            async for chunk in resp.stream(min_chunk_size=CHUNK):
                await asyncio.to_thread(w.write, memoryview(chunk))
        except BaseException as e:
            await asyncio.to_thread(w.abort)
            if isinstance(e, ObstoreError | OSError):
                raise self._error("read", key, e) from e
            raise
        return await asyncio.to_thread(w.commit, key, sha256=sha256, size=size)

    async def put_bytes(self, key: str, data: bytes) -> None:
        check_key(key)
        try:
            await obstore.put_async(self._store, key, bytes(data), use_multipart=False)
        except (ObstoreError, OSError) as e:
            raise self._error("store", key, e) from e

    async def get_bytes(self, key: str) -> bytes:
        check_key(key)
        try:
            resp = await obstore.get_async(self._store, key)
            return bytes(await resp.bytes_async())
        except FileNotFoundError as e:
            if "NoSuchBucket" in str(e):
                raise self._error("read", key, e) from e
            raise ObjectNotFound(key, f"in {self.url}") from None
        except (ObstoreError, OSError) as e:
            raise self._error("read", key, e) from e

    async def stat(self, key: str) -> ObjectInfo | None:
        check_key(key)
        try:
            meta = await obstore.head_async(self._store, key)
        except FileNotFoundError:
            return None
        except (ObstoreError, OSError) as e:
            raise self._error("stat", key, e) from e
        return ObjectInfo(
            key=key, size=int(meta["size"]), last_modified=meta["last_modified"].timestamp()
        )

    async def delete(self, key: str) -> None:
        check_key(key)
        await self._delete_many([key])

    async def _delete_many(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = list(keys[i : i + _DELETE_BATCH])
            try:
                await obstore.delete_async(self._store, batch)
            except FileNotFoundError:
                pass
            except (ObstoreError, OSError) as e:
                raise self._error("delete", batch[0], e) from e

    async def delete_prefix(self, prefix: str) -> int:
        objs = await self.list(prefix)
        await self._delete_many([o.key for o in objs])
        return len(objs)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        p = norm_prefix(prefix)
        out: list[ObjectInfo] = []
        try:
            async for chunk in obstore.list(self._store, p or None, chunk_size=1000):
                for meta in chunk:
                    out.append(
                        ObjectInfo(
                            key=meta["path"],
                            size=int(meta["size"]),
                            last_modified=meta["last_modified"].timestamp(),
                        )
                    )
        except (ObstoreError, OSError) as e:
            raise self._error("list", p or "/", e) from e
        out.sort(key=lambda o: o.key)
        return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _at(endpoint: str | None) -> str:
    return f" at {endpoint}" if endpoint else ""
