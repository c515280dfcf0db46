"""`code-interpreter-v1` built by the node itself, so the stock `e2b-code-interpreter` SDK
works on a fresh node without a manual step.

Why in the background at start: the template is `base` + Debian's Jupyter packages + a start
command snapshotted with memory; its packages layer takes minutes the first time (apt in a
chroot) and its start command needs the node serving (the E2B build API boots a sandbox).
Building it before serving would hold every other request back for minutes, and building it
at the first create would make that create wait the whole time. So the node starts it as soon
as it serves, when it is missing or out of date (the rootfs stamp says so; `aenv template
build-code-interpreter` checks the same), and a create of `code-interpreter-v1` meanwhile
waits for the build up to `CREATE_PATIENCE` seconds — under the SDK's 60-second request
timeout — then answers 503 with `Retry-After`. A build that failed leaves the 404 as it was,
its reason in the message and the log.

The build is exactly `aenv template build-code-interpreter --quiet`, run as a child process
against this node (its listen address and its own key, as on the host): its rootfs part needs
root and chroot, which a child keeps out of the server's event loop and can be stopped with
the server. `AENV_CODE_INTERPRETER_AUTOBUILD=0` turns it off (the tests and the benchmark do:
they build it only where they use it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass

from ..config import Settings
from ..errors import NotFound, Unavailable
from . import code_interpreter as ci

log = logging.getLogger("aenv.builds")

TEMPLATE = ci.TEMPLATE_NAME
# Seconds a create of the template waits for a build in flight: under the SDK's 60 s.
CREATE_PATIENCE = 45.0
# What a create told to come back later is told (seconds).
RETRY_AFTER = 30.0
# Seconds the child waits for the node to take connections before it gives up.
SERVING_PATIENCE = 120.0
# Variables that would point the child's CLI at another server than this node.
_ELSEWHERE = ("AENV_URL", "AENV_CONTEXT", "E2B_API_URL", "E2B_DOMAIN", "E2B_API_KEY")


@dataclass
class AutobuildState:
    """Where the build is: `idle` (not needed or not on), `building`, `done`, `failed`."""

    status: str = "idle"
    started: float = 0.0
    reason: str = ""


class CodeInterpreterAutobuild:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state = AutobuildState()
        self._task: asyncio.Task[None] | None = None
        self._proc: asyncio.subprocess.Process | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if not self.settings.code_interpreter_autobuild or self._task is not None:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="ci-autobuild")

    async def close(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.terminate()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    # ------------------------------------------------------------------ creates
    async def before_create(self, template: str) -> None:
        """A create of `template` waits for a build of it in flight; past the patience,
        a 503 with Retry-After. A failed build makes a missing template's 404 say why."""
        if template.split(":", 1)[0] != TEMPLATE or self._task is None:
            return
        if self.state.status == "building":
            try:
                await asyncio.wait_for(asyncio.shield(self._task), CREATE_PATIENCE)
            except TimeoutError:
                took = time.monotonic() - self.state.started
                raise Unavailable(
                    f"template {TEMPLATE!r} is being built by this node (for {took:.0f} s, "
                    "a few minutes the first time): try again shortly",
                    retry_after=RETRY_AFTER,
                ) from None

    def explain_missing(self, error: NotFound, template: str) -> NotFound:
        """The 404 of a create of a missing template, with why the node's build failed."""
        if template.split(":", 1)[0] != TEMPLATE or self.state.status != "failed":
            return error
        return NotFound(
            f"{error.message}; the node's build of it failed ({self.state.reason}): "
            "run `aenv template build-code-interpreter` on the node"
        )

    # ------------------------------------------------------------------ the build
    async def _run(self) -> None:
        self.state = AutobuildState("building", time.monotonic())
        try:
            await self._wait_serving()
            code, output = await self._build()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure is the build's, reported below
            code, output = -1, repr(e)
        if code == 0:
            self.state.status = "done"
            log.info("template %s is up to date", TEMPLATE)
            return
        last = output.strip().splitlines()[-1] if output.strip() else f"exit status {code}"
        self.state.status, self.state.reason = "failed", last[:500]
        log.error("building template %s failed (exit %s):\n%s", TEMPLATE, code, output[-4000:])

    async def _wait_serving(self) -> None:
        """The node takes connections only once every part has started (this one too)."""
        deadline = time.monotonic() + SERVING_PATIENCE
        while True:
            try:
                host = self.settings.host.strip("[]")
                if host in ("0.0.0.0", "::", ""):
                    host = "127.0.0.1"  # listening everywhere: here too
                _, writer = await asyncio.open_connection(host, self.settings.port)
                writer.close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    def command(self) -> tuple[list[str], dict[str, str]]:
        """The build's command line and environment: aimed at this node's own listener with
        `--url` (a context saved by `aenv auth` on the host would otherwise win over the
        listen address), over loopback; its own certificate need not name 127.0.0.1."""
        env = {k: v for k, v in os.environ.items() if k not in _ELSEWHERE}
        env["AENV_HOME"] = str(self.settings.home)
        host = self.settings.host.strip("[]")
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"  # listening everywhere: here too
        if ":" in host:
            host = f"[{host}]"
        if self.settings.tls_cert:
            env["AENV_TLS_VERIFY"] = "false"
        url = f"{self.settings.scheme}://{host}:{self.settings.port}"
        # The `aenv` command beside this interpreter (the venv's, or the image's).
        argv = [os.path.join(os.path.dirname(sys.executable), "aenv"), "--url", url]
        argv += ["template", "build-code-interpreter", "--quiet"]
        return argv, env

    async def _build(self) -> tuple[int, str]:
        argv, env = self.command()
        log.info("building template %s in the background (%s)", TEMPLATE, " ".join(argv[1:]))
        self._proc = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await self._proc.communicate()
        return self._proc.returncode or 0, out.decode(errors="replace")
