"""OCI images as sandboxes: pulling (with the node's registry settings) and booting a sandbox
on any layer stack through a transient internal template.

`Sandboxes.create` boots from a catalog template. A cold start from an image, and every
step of a template build, registers an internal template (`internal`, layers held while it
exists), creates the sandbox (which then holds the layers itself) and drops the template
again. The image's template is keyed by its manifest digest and shared by concurrent cold
starts of the same image; it is not kept afterwards, so pulled layers nobody runs on stay
evictable and the layer cache bound (`AENV_LAYER_CACHE_GB`) holds.

Image config honoured on a cold start: Env (under the request's envVars), WorkingDir (the
default cwd), User (a name or uid resolved through the image's /etc/passwd; unknown: root;
unset: root, as docker runs it). Entrypoint/Cmd are recorded as sandbox metadata
(`aenv.entrypoint`, `aenv.cmd`); envd is the sandbox's init, so they only run when asked
(`startEntrypoint`), as a background process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..config import ImageSettings, Settings
from ..domain import (
    BuildInfo,
    CreateRequest,
    SandboxRecord,
    TemplateKind,
    TemplateRecord,
    Timings,
    utcnow,
)
from ..errors import AenvError, BadRequest, NotFound
from ..images.cache import holder
from ..images.pull import ImageConfig, ProgressFn, PulledImage, pull
from ..images.reference import candidates
from ..images.registry import Credential
from ..orchestrator import Orchestrator
from . import stack

log = logging.getLogger("aenv.builds")

# Who holds pulled layers until their sandbox or template does: (kind, ident).
Pin = tuple[str, str]


def registry_credentials(
    settings: ImageSettings, image: str, cfg: Mapping[str, Any] | None
) -> dict[str, Credential] | None:
    """E2B's `fromImageRegistry` as pull credentials for the image's registry."""
    if not cfg:
        return None
    kind = str(cfg.get("type") or "registry")
    if kind == "registry":
        user, password = cfg.get("username"), cfg.get("password")
    elif kind == "gcp":
        # GCR / Artifact Registry take the service account key as a password.
        user, password = "_json_key", cfg.get("serviceAccountJson")
        if isinstance(password, dict):
            password = json.dumps(password)
    elif kind == "aws":
        raise BadRequest(
            "fromImageRegistry type 'aws' is not supported here; pass an ECR token as "
            "type 'registry' (username AWS, password from `aws ecr get-login-password`)"
        )
    else:
        raise BadRequest(f"unknown fromImageRegistry type {kind!r}")
    if not isinstance(user, str) or not isinstance(password, str) or not user or not password:
        raise BadRequest("fromImageRegistry needs a username and a password")
    hosts = {ref.registry for ref in candidates(image, settings)}
    return {h: Credential(user, password) for h in hosts}


def image_template_id(img: PulledImage) -> str:
    return "img-" + img.manifest_digest.partition(":")[2][:40]


class Images:
    def __init__(self, settings: Settings, orchestrator: Orchestrator) -> None:
        self.settings = settings.images
        self.orch = orchestrator
        # Registration counts of the transient templates (concurrent boots share one).
        self._users: dict[str, int] = {}
        self._lock = asyncio.Lock()

    async def pull(
        self,
        image: str,
        *,
        progress: ProgressFn | None = None,
        registry: Mapping[str, Any] | None = None,
        pin: Pin | None = None,
    ) -> PulledImage:
        """Pulls into the node's layer store; `pin` holds the layers until released."""
        creds = registry_credentials(self.settings, image, registry)
        storage = self.orch.storage
        return await pull(
            self.settings,
            storage.layers,
            image,
            cache=storage.refs,
            holder=None if pin is None else holder(*pin),
            progress=progress,
            credentials=creds,
        )

    async def release(self, pin: Pin) -> None:
        await asyncio.to_thread(self.orch.storage.release, *pin)

    def passwd(self, layers: list[str]) -> list[stack.PasswdEntry]:
        return stack.passwd([self.orch.storage.layers.path(d) for d in layers])

    # ------------------------------------------------------------------ booting
    async def boot(
        self, rec: TemplateRecord, req: CreateRequest, timings: Timings | None = None
    ) -> SandboxRecord:
        """Creates a sandbox from `rec`, an internal template registered for the call."""
        tid = rec.template_id
        async with self._lock:
            count = self._users.get(tid, 0)
            if count == 0:
                await self.orch.templates.register(replace(rec, internal=True), publish=False)
            self._users[tid] = count + 1
        try:
            return await self.orch.sandboxes.create(replace(req, template_id=tid), timings)
        finally:
            async with self._lock:
                self._users[tid] -= 1
                if self._users[tid] == 0:
                    del self._users[tid]
                    await self.unregister(tid)

    async def unregister(self, template_id: str) -> None:
        with contextlib.suppress(NotFound):
            await self.orch.delete_template(template_id)

    # ------------------------------------------------------------------ cold start
    def image_record(self, img: PulledImage) -> TemplateRecord:
        cfg = img.config
        user, warning = stack.resolve_user(self.passwd(img.layers), cfg.user)
        if warning:
            log.info("image %s: %s", img.reference, warning)
        return TemplateRecord(
            template_id=image_template_id(img),
            kind=TemplateKind.IMAGE,
            layers=list(img.layers),
            internal=True,
            env=cfg.env_dict(),
            user=user or "root",
            workdir=cfg.workdir or None,
            created_at=utcnow().isoformat(),
            build=BuildInfo(image=img.reference, image_digest=img.digest),
        )

    async def cold_start(
        self,
        image: str,
        req: CreateRequest,
        *,
        registry: Mapping[str, Any] | None = None,
        start_entrypoint: bool = False,
        timings: Timings | None = None,
    ) -> SandboxRecord:
        pin = ("coldstart", uuid.uuid4().hex)
        try:
            img = await self.pull(image, registry=registry, pin=pin)
            rec = await asyncio.to_thread(self.image_record, img)
            req = replace(req, metadata={**image_metadata(img), **req.metadata})
            record = await self.boot(rec, req, timings)
        finally:
            await self.release(pin)
        if rec.workdir and record.address:
            # As docker does at run time: a WorkingDir missing in the image is created.
            try:
                await self.orch.envd(record).make_dir(rec.workdir, user="root")
            except AenvError as e:
                log.info("creating WorkingDir %s of %s: %s", rec.workdir, image, e.message)
        argv = [*img.config.entrypoint, *img.config.cmd]
        if start_entrypoint and argv:
            await self.start_background(record, argv)
        return record

    async def start_background(self, record: SandboxRecord, argv: list[str]) -> int:
        """Starts `argv` in the sandbox and leaves it running; returns its pid."""
        async for ev in self.orch.envd(record).process(argv[0], argv[1:]):
            if ev.kind == "start":
                return ev.pid
            if ev.kind == "end":
                break
        return 0


def image_metadata(img: PulledImage) -> dict[str, str]:
    cfg: ImageConfig = img.config
    meta = {"aenv.image": f"{img.reference.partition('@')[0]}@{img.manifest_digest}"}
    if cfg.entrypoint:
        meta["aenv.entrypoint"] = json.dumps(cfg.entrypoint)
    if cfg.cmd:
        meta["aenv.cmd"] = json.dumps(cfg.cmd)
    return meta
