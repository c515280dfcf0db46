"""OCI images: `POST /sandboxes-cold` (a sandbox straight from an image) and `POST /images/pull`
(pull into the node's layer cache, progress streamed as NDJSON, for `aenv pull`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import Field

from aenv.builds.images import Images
from aenv.domain import Timings
from aenv.errors import AenvError
from aenv.images.pull import LayerProgress
from aenv.orchestrator import check_timeout

from ..auth import key_name, require_api_key
from ..deps import SecretsDep, SettingsDep
from ..models import ErrorBody, Sandbox, SandboxOptions, check_secrets
from ..wire import ApiRequest
from .builds import BuilderDep
from .sandboxes import add_timing

router = APIRouter(
    tags=["images"],
    dependencies=[Depends(require_api_key)],
    responses={s: {"model": ErrorBody} for s in (400, 401, 403, 404, 409, 500, 502, 503)},
)


class RegistryAuth(ApiRequest):
    """Credentials for the image's registry (E2B's `fromImageRegistry` shapes)."""

    type: str = "registry"
    username: str | None = None
    password: str | None = None
    service_account_json: str | dict[str, Any] | None = Field(
        default=None, alias="serviceAccountJson"
    )

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class ColdSandbox(SandboxOptions):
    """Body of `POST /sandboxes-cold`: `NewSandboxV2` with `image` instead of `templateID`."""

    image: str = Field(min_length=1, max_length=512)
    secure: bool | None = None  # ignored: every sandbox gets an envd access token
    registry: RegistryAuth | None = None
    # Start the image's Entrypoint+Cmd as a background process once the sandbox runs.
    start_entrypoint: bool = Field(default=False, alias="startEntrypoint")


class PullRequest(ApiRequest):
    image: str = Field(min_length=1, max_length=512)
    registry: RegistryAuth | None = None


def get_images(builder: BuilderDep) -> Images:
    return builder.images


@router.post("/sandboxes-cold", status_code=201, summary="Create a sandbox from an OCI image")
async def create_cold(
    body: ColdSandbox,
    request: Request,
    response: Response,
    settings: SettingsDep,
    secrets: SecretsDep,
    images: Images = Depends(get_images),
) -> Sandbox:
    check_timeout(body.timeout, settings)
    req = body.to_request(key_name(request))
    await check_secrets(req.egress, secrets)
    timings = Timings()
    record = await images.cold_start(
        body.image,
        req,
        registry=body.registry.as_dict() if body.registry else None,
        start_entrypoint=body.start_entrypoint,
        timings=timings,
    )
    add_timing(response, timings)
    return Sandbox.from_record(record, settings.domain)


@router.post(
    "/images/pull",
    summary="Pull an image into the layer cache; NDJSON progress",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}}},
)
async def pull_image(body: PullRequest, images: Images = Depends(get_images)) -> StreamingResponse:
    """One JSON object per line: `{"type": "layer", "digest", "done", "total", "status"}`
    as layers progress (at most ~10/s per layer), then `{"type": "done", "image": {...}}`
    or `{"type": "error", "code", "message"}`."""
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    last: dict[str, float] = {}

    def progress(p: LayerProgress) -> None:
        now = time.monotonic()
        if p.status == "downloading" and now - last.get(p.digest, 0.0) < 0.1:
            return
        last[p.digest] = now
        queue.put_nowait(
            {
                "type": "layer",
                "digest": p.digest,
                "done": p.done,
                "total": p.total,
                "status": p.status,
            }
        )

    async def run() -> None:
        try:
            img = await images.pull(
                body.image,
                progress=progress,
                registry=body.registry.as_dict() if body.registry else None,
            )
            queue.put_nowait({"type": "done", "image": img.to_json()})
        except AenvError as e:
            queue.put_nowait({"type": "error", **e.to_json()})
        except Exception as e:  # noqa: BLE001 (reported in the stream)
            queue.put_nowait({"type": "error", "code": 500, "message": f"pull failed: {e}"})
        finally:
            queue.put_nowait(None)

    async def lines() -> AsyncIterator[bytes]:
        task = asyncio.create_task(run())
        try:
            while (item := await queue.get()) is not None:
                yield (json.dumps(item) + "\n").encode()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    return StreamingResponse(lines(), media_type="application/x-ndjson")
