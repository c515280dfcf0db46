"""The end of a build: the template made of its final layer stack.

With startCmd (or a lone readyCmd): boot on the final stack, start startCmd in the
background, poll readyCmd (every 0.5-2 s, up to `ready_timeout`), then snapshot the sandbox
WITH memory under the template's id: sandboxes created from the template restore that
snapshot, so the started process is running in each of them. Without: the final stack
(+ env/user/workdir, the WORKDIR created if no step did) is the template, booted cold.

The template keeps its id across builds (same name: same template); registering a new
build's record replaces the earlier one (its layer holds, a memory image it no longer uses)
unless tags stay on the earlier one (tags.py: then it is kept under an id of its own).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from ..domain import BuildInfo, TemplateKind, TemplateRecord, utcnow
from ..envd_client import EnvdClient
from . import stack, steps
from .job import BuildFailed, BuildJob, Stack
from .spec import BuildSpec, BuildState, Step, cache_key

READY_TIMEOUT = 120.0
READY_CHECK_TIMEOUT = 30.0


async def finalize(job: BuildJob, spec: BuildSpec, at: Stack, ready_timeout: float) -> None:
    ab = job.ab
    b = ab.record
    ab.step = "finalize"
    state = at.state
    user, warning = stack.resolve_user(
        await asyncio.to_thread(job.images.passwd, at.layers), state.user
    )
    if warning:
        ab.log("warn", f"[finalize] USER {state.user}: {warning}")
    build = replace(
        at.origin,
        build_id=b.build_id,
        name=b.name,
        status="ready",
        start_cmd=spec.start_cmd,
        ready_cmd=spec.ready_cmd,
        metadata=dict(spec.metadata or {}),
    )
    if spec.start_cmd or spec.ready_cmd:
        await _snapshot_started(job, spec, at, user, build, ready_timeout)
        return
    await _workdir_made(job, at)
    async with job.tags.placing(b.template_id, b.build_id, b.tags) as target:
        rec = TemplateRecord(
            template_id=target,
            kind=TemplateKind.TEMPLATE,
            layers=at.layers,
            names=list(b.names) if target == b.template_id else [],
            env=dict(state.env),
            user=user,
            workdir=state.workdir,
            cpu_count=b.cpu_count,
            memory_mb=b.memory_mb,
            created_at=utcnow().isoformat(),
            build=build,
        )
        await job.orch.templates.register(rec)
    ab.log("info", f"[finalize] template {b.template_id} registered ({len(at.layers)} layers)")


async def _workdir_made(job: BuildJob, at: Stack) -> None:
    """A WORKDIR no step created is made (a layer of its own) before the end."""
    ab = job.ab
    state = at.state
    layers = at.layers
    if (
        state.workdir
        and at.ensured != state.workdir
        and not await job.has_dir(layers, state.workdir)
    ):
        fin = Step("WORKDIR", [state.workdir])
        key = cache_key(layers, fin, state)
        top = None if at.forced else await job.cached_layer(key)
        if top is not None:
            layers = [top, *layers]
        else:
            ab.log("info", f"[finalize] creating WORKDIR {state.workdir}")
            layers = await job.layer_step(None, fin, layers, state)
            await asyncio.to_thread(job.store.cache, key, layers[0])
    at.layers = layers


async def _snapshot_started(
    job: BuildJob,
    spec: BuildSpec,
    at: Stack,
    user: str | None,
    build: BuildInfo,
    ready_timeout: float,
) -> None:
    ab = job.ab
    b = ab.record
    state = at.state
    entries = await asyncio.to_thread(job.images.passwd, at.layers)
    run_as = user or stack.default_user(entries)
    sbx, rpc = await job.boot(at.layers, state, user)
    if state.workdir:
        await rpc.make_dir(state.workdir, user=run_as)
    bg = steps.Background()
    if spec.start_cmd:
        ab.log("info", f'[finalize] start command "{spec.start_cmd}"')
        bg.start(
            rpc,
            spec.start_cmd,
            user=run_as,
            env=state.env,
            cwd=state.workdir,
            on_line=ab.output("[start] "),
        )
        await bg.started.wait()
        if bg.error:
            raise BuildFailed(f"finalize: the start command failed: {bg.error}", "finalize")
    try:
        await _wait_ready(job, spec, rpc, bg, run_as, state, ready_timeout)
    finally:
        await bg.detach()
    await asyncio.sleep(0.2)  # let envd see the stream go before the checkpoint
    ab.log("info", "[finalize] snapshotting the running sandbox (memory and files)")
    async with job.tags.placing(b.template_id, b.build_id, b.tags) as target:
        # Internal until it is the template: neither listed nor published as a snapshot.
        rec = await job.orch.snapshotter.snapshot(
            sbx.sandbox_id,
            None,
            template_id=target,
            parent=at.origin.origin,
            build=build,
            internal=True,
        )
        rec.kind = TemplateKind.TEMPLATE
        rec.internal = False
        rec.names = list(b.names) if target == b.template_id else []
        rec.cpu_count, rec.memory_mb = b.cpu_count, b.memory_mb
        await job.orch.templates.register(rec)
    ab.log("info", f"[finalize] template {rec.template_id} registered (snapshot with memory)")


async def _wait_ready(
    job: BuildJob,
    spec: BuildSpec,
    rpc: EnvdClient,
    bg: steps.Background,
    user: str,
    state: BuildState,
    ready_timeout: float,
) -> None:
    ab = job.ab
    deadline = time.monotonic() + ready_timeout
    delay = 0.5
    attempt = 0
    while True:
        if bg.end is not None and bg.end.exit_code != 0:
            raise BuildFailed(
                f'finalize: the start command "{spec.start_cmd}" exited before ready: '
                f"{bg.end.status}",
                "finalize",
            )
        if not spec.ready_cmd:
            await asyncio.sleep(2.0)
            if bg.end is not None and bg.end.exit_code != 0:
                continue  # reported above
            ab.log("info", "[finalize] no ready command: ready after 2s")
            return
        attempt += 1
        end = await steps.run_shell(
            rpc,
            spec.ready_cmd,
            user=user,
            env=state.env,
            cwd=state.workdir,
            timeout=READY_CHECK_TIMEOUT,
            on_line=lambda _s, line: ab.log("debug", f"[ready] {line}"),
            shell=steps.LOGIN_SHELL,
        )
        if end.exit_code == 0:
            ab.log("info", f'[finalize] ready: "{spec.ready_cmd}" succeeded')
            return
        if time.monotonic() >= deadline:
            raise BuildFailed(
                f'finalize: the ready command "{spec.ready_cmd}" did not succeed within '
                f"{ready_timeout:.0f}s (last: {end.status or end.error})",
                "finalize",
            )
        if attempt == 1 or attempt % 10 == 0:
            ab.log("info", f"[finalize] waiting for ready ({end.status or end.error})")
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 2.0)
