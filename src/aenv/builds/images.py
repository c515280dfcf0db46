"""OCI images as sandboxes: pulling (with the node's registry settings) and booting a sandbox
on any layer stack through a transient internal template doc.

`orchestrator.create` boots from a catalog template. A cold start from an image, and every
step of a template build, registers an internal doc (`internal: true`, layers held while it
exists), creates the sandbox (which then holds the layers itself) and drops the doc again.
The image's doc is keyed by its manifest digest and shared by concurrent cold starts of the
same image; it is not kept afterwards, so pulled layers nobody runs on stay evictable and
the layer cache bound (`AENV_LAYER_CACHE_GB`) holds.

Image config honoured on a cold start: Env (under the request's envVars), WorkingDir (the
default cwd), User (a name or uid resolved through the image's /etc/passwd; unknown: root;
unset: root, as docker runs it). Entrypoint/Cmd are recorded as sandbox metadata
(`aenv.entrypoint`, `aenv.cmd`); envd is the sandbox's init, so they only run when asked
(`startEntrypoint`), as a background process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..errors import AenvError, BadRequest
from ..images.cache import holder
from ..images.pull import ImageConfig, ProgressFn, PulledImage, pull
from ..images.reference import candidates
from ..images.registry import Credential
from ..images.settings import ImageSettings
from ..orchestrator.lifecycle import Orchestrator
from ..orchestrator.models import CreateRequest, SandboxRecord, utcnow
from ..orchestrator.service import ENVD_PORT, Timings
from . import stack

log = logging.getLogger("aenv.builds")


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
    def __init__(self, orchestrator: Orchestrator, settings: ImageSettings | None = None) -> None:
        self.orch = orchestrator
        self.settings = settings or ImageSettings()
        self._users: dict[str, int] = {}
        # Registration counts of the transient docs (concurrent boots share one).
        self._lock = asyncio.Lock()

    async def pull(
        self,
        image: str,
        *,
        progress: ProgressFn | None = None,
        registry: Mapping[str, Any] | None = None,
        pin: str | None = None,
    ) -> PulledImage:
        """Pulls into the node's layer store; `pin` keeps a reference until released."""
        creds = registry_credentials(self.settings, image, registry)
        return await pull(
            self.settings,
            self.orch.storage.layers,
            image,
            progress=progress,
            cache=self.orch.storage.refs,
            holder=pin,
            credentials=creds,
        )

    def release(self, pin: str) -> None:
        self.orch.storage.refs.release(pin)

    def passwd(self, layers: list[str]) -> list[stack.PasswdEntry]:
        return stack.passwd([self.orch.storage.layers.path(d) for d in layers])

    # ------------------------------------------------------------------ booting
    async def boot(
        self,
        template_id: str,
        doc: dict[str, Any],
        req: CreateRequest,
        timings: Timings | None = None,
    ) -> SandboxRecord:
        """Creates a sandbox from `doc` (an internal template registered for the call)."""
        async with self._lock:
            count = self._users.get(template_id, 0)
            if count == 0:
                await asyncio.to_thread(self._register, template_id, doc)
            self._users[template_id] = count + 1
        try:
            return await self.orch.create(replace(req, template_id=template_id), timings)
        finally:
            async with self._lock:
                self._users[template_id] -= 1
                if self._users[template_id] == 0:
                    del self._users[template_id]
                    await asyncio.to_thread(self._unregister, template_id)

    def _register(self, template_id: str, doc: dict[str, Any]) -> None:
        self.orch.storage.hold("template", template_id, list(doc["layers"]))
        self.orch.catalog.put_template(template_id, {**doc, "internal": True}, [])

    def _unregister(self, template_id: str) -> None:
        self.orch.catalog.delete_template(template_id)
        self.orch.storage.release("template", template_id)

    # ------------------------------------------------------------------ cold start
    def image_doc(self, img: PulledImage) -> dict[str, Any]:
        cfg = img.config
        user, warning = stack.resolve_user(self.passwd(img.layers), cfg.user)
        if warning:
            log.info("image %s: %s", img.reference, warning)
        return {
            "kind": "image",
            "internal": True,
            "layers": list(img.layers),
            "env": cfg.env_dict(),
            "user": user or "root",
            "workdir": cfg.workdir or None,
            "image": img.to_json(),
            "created_at": utcnow().isoformat(),
        }

    async def cold_start(
        self,
        image: str,
        req: CreateRequest,
        *,
        registry: Mapping[str, Any] | None = None,
        start_entrypoint: bool = False,
        timings: Timings | None = None,
    ) -> SandboxRecord:
        pin = holder("coldstart", uuid.uuid4().hex)
        try:
            img = await self.pull(image, registry=registry, pin=pin)
            doc = await asyncio.to_thread(self.image_doc, img)
            meta = image_metadata(img)
            req = replace(req, metadata={**meta, **req.metadata})
            record = await self.boot(image_template_id(img), doc, req, timings)
        finally:
            await asyncio.to_thread(self.release, pin)
        workdir = doc.get("workdir")
        if workdir and record.address:
            # As docker does at run time: a WorkingDir missing in the image is created.
            rpc = self.orch.envd.rpc(record.address, ENVD_PORT, record.envd_access_token)
            try:
                await rpc.make_dir(str(workdir), user="root")
            except AenvError as e:
                log.info("creating WorkingDir %s of %s: %s", workdir, image, e.message)
        argv = [*img.config.entrypoint, *img.config.cmd]
        if start_entrypoint and argv:
            await self.start_background(record, argv)
        return record

    async def start_background(self, record: SandboxRecord, argv: list[str]) -> int:
        """Starts `argv` in the sandbox and leaves it running; returns its pid."""
        assert record.address is not None
        rpc = self.orch.envd.rpc(record.address, ENVD_PORT, record.envd_access_token)
        async for ev in rpc.process(argv[0], argv[1:]):
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
