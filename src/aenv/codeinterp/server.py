"""The routes on port 49999: `/health`, `/execute`, `/contexts`.

Contexts are kept by id; each language has a default one (python's is started with the
server, the others at their first use), which `/execute` without `context_id` uses.
Executions in one context run one after the other (its lock); errors are the project's
`{"code", "message"}` JSON, which the SDK shows as the message of its exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import urllib.request
import uuid
from typing import Any, Protocol

from ..envd.httpserver import HTTPError, Request, Response, log, serve_connection
from . import events
from .bashctx import BashContext
from .pyctx import PythonContext

MAX_BODY = 16 * 1024 * 1024
ENVD_ENVS = "http://127.0.0.1:49983/envs"


class Context(Protocol):
    id: str
    language: str
    cwd: str
    lock: asyncio.Lock

    async def start(self) -> None: ...
    async def setenv(self, envs: dict[str, str]) -> None: ...
    def execute(self, code: str, envs: dict[str, str]) -> Any: ...
    async def interrupt(self) -> None: ...
    async def restart(self) -> None: ...
    async def close(self) -> None: ...


def sandbox_envs(token: str | None) -> dict[str, str]:
    """The sandbox's environment variables (given at create), from envd."""
    req = urllib.request.Request(ENVD_ENVS, headers={"X-Access-Token": token} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            data = json.loads(r.read() or b"{}")
    except Exception as e:
        log("codeinterp: envd /envs:", repr(e))
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


class Interpreter:
    def __init__(self, default_cwd: str, run_dir: str) -> None:
        self.default_cwd = default_cwd
        self.run_dir = run_dir
        self.contexts: dict[str, Context] = {}
        self.defaults: dict[str, str] = {}
        self.default_lock = asyncio.Lock()
        # Contexts that got the sandbox's own variables (once each, at their first run).
        self.env_applied: set[str] = set()

    async def create(self, language: str, cwd: str | None) -> Context:
        lang = events.normalize_language(language)
        cls: Any = {"python": PythonContext, "bash": BashContext}.get(lang)
        if cls is None:
            raise HTTPError(
                400, f"language {language!r} is not supported (supported: python, bash)"
            )
        cwd = cwd or self.default_cwd
        if not await asyncio.to_thread(os.path.isdir, cwd):
            raise HTTPError(400, f"cwd {cwd!r} is not a directory")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AENV_")}
        ctx: Context = cls(uuid.uuid4().hex, cwd, env, self.run_dir)
        await ctx.start()
        self.contexts[ctx.id] = ctx
        return ctx

    async def default(self, language: str | None) -> Context:
        lang = events.normalize_language(language)
        async with self.default_lock:
            cid = self.defaults.get(lang)
            if cid is not None and cid in self.contexts:
                return self.contexts[cid]
            ctx = await self.create(lang, None)
            self.defaults[lang] = ctx.id
            return ctx

    def get(self, cid: str) -> Context:
        ctx = self.contexts.get(cid)
        if ctx is None:
            raise HTTPError(404, f"context {cid} not found")
        return ctx

    async def remove(self, cid: str) -> None:
        ctx = self.get(cid)
        del self.contexts[cid]
        for lang, d in list(self.defaults.items()):
            if d == cid:
                del self.defaults[lang]
        self.env_applied.discard(cid)
        await ctx.close()

    async def apply_sandbox_envs(self, ctx: Context, token: str | None) -> None:
        if ctx.id in self.env_applied:
            return
        self.env_applied.add(ctx.id)
        envs = await asyncio.to_thread(sandbox_envs, token)
        ok = {k: v for k, v in envs.items() if events.valid_env_name(k) and "\0" not in v}
        if ok:
            await ctx.setenv(ok)

    # -- HTTP -----------------------------------------------------------------------------

    async def handle(self, req: Request, resp: Response) -> None:
        path, m = req.path.rstrip("/") or "/", req.method
        if path == "/health":
            await resp.send_json(200, "OK")
        elif path == "/execute" and m == "POST":
            await self.execute(req, resp)
        elif path == "/contexts" and m == "POST":
            body = await self._json(req)
            ctx = await self.create(str(body.get("language") or "python"), body.get("cwd"))
            await resp.send_json(200, _describe(ctx))
        elif path == "/contexts" and m == "GET":
            await resp.send_json(200, [_describe(c) for c in self.contexts.values()])
        elif path.startswith("/contexts/") and path.endswith("/restart") and m == "POST":
            ctx = self.get(path[len("/contexts/") : -len("/restart")])
            async with ctx.lock:
                await ctx.restart()
            self.env_applied.discard(ctx.id)
            await resp.send(204)
        elif path.startswith("/contexts/") and m == "DELETE":
            await self.remove(path[len("/contexts/") :])
            await resp.send(204)
        else:
            raise HTTPError(404, f"no route for {m} {path}")

    async def _json(self, req: Request) -> dict[str, Any]:
        raw = await req.body.read_all(MAX_BODY)
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise HTTPError(400, f"invalid JSON: {e}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        return body

    async def execute(self, req: Request, resp: Response) -> None:
        body = await self._json(req)
        code = body.get("code")
        if not isinstance(code, str):
            raise HTTPError(400, "code must be a string")
        cid, language = body.get("context_id"), body.get("language")
        if cid and language:
            raise HTTPError(400, "give either context_id or language, not both")
        try:
            envs = events.check_envs(body.get("env_vars"))
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        ctx = self.get(str(cid)) if cid else await self.default(language)
        async with ctx.lock:
            await self.apply_sandbox_envs(ctx, req.header("x-access-token") or None)
            await resp.start(200, [("Content-Type", "application/x-ndjson")])
            # A caller that goes away (its timeout, a cancel) stops the code too, even one
            # that prints nothing: otherwise the context stays busy for the next caller.
            # Not once the code is done: the SDK closes its connection right after the end.
            running = [True]

            def on_gone(t: asyncio.Task[None]) -> None:
                if not t.cancelled() and running[0]:
                    asyncio.ensure_future(ctx.interrupt())

            gone = asyncio.create_task(req.conn.wait_closed())
            gone.add_done_callback(on_gone)
            gen = ctx.execute(code, envs)
            try:
                async for ev in gen:
                    await resp.write(events.ndjson(ev))
                running[0] = False
                await resp.write(events.ndjson(events.end()))
                await resp.end()
            finally:
                gone.cancel()
                with contextlib.suppress(Exception):
                    await gen.aclose()


def _describe(ctx: Context) -> dict[str, str]:
    return {"id": ctx.id, "language": ctx.language, "cwd": ctx.cwd}


async def serve(port: int, default_cwd: str, run_dir: str) -> None:
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    interp = Interpreter(default_cwd, run_dir)
    # The python context is ready before the port opens: the template's ready check (and
    # so the snapshot every sandbox starts from) has a warm kernel.
    await interp.default("python")

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await serve_connection(r, w, interp.handle)

    server = await asyncio.start_server(on_conn, "0.0.0.0", port)
    log(f"codeinterp: serving on {port}")
    async with server:
        await server.serve_forever()
