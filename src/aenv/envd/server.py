"""Routing, authentication, ``/init``, ``/envs``, ``/health`` and the serve loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from typing import TYPE_CHECKING

from . import identity
from .envrules import env_problem
from .httpserver import READ_SIZE, HTTPError, Request, Response, log, serve_connection

# Loaded with envd, not on the first /oom: by then the sandbox is out of memory and reading
# a module can fail (ENOMEM), which cost a rescue its first seconds.
from .oomkill import kill_largest
from .rpc import Method, RPCError, dispatch
from .state import State, User

if TYPE_CHECKING:
    from .filesystem import Filesystem
    from .portfwd import PortForwarder
    from .process import ProcessManager

MAX_INIT_BODY = 4 * 1024 * 1024
# Names shared with portfwd, which is only imported where it runs.
PORT_FORWARD_ENV = "AENV_ENVD_PORT_FORWARD"
FORWARD_HOST_ENV = "AENV_ENVD_FORWARD_HOST"


def _basic_user(req: Request) -> str | None:
    """User name from ``Authorization: Basic base64("name:")``."""
    value = req.header("authorization")
    if not value:
        return None
    scheme, _, cred = value.partition(" ")
    if scheme.lower() != "basic":
        return None
    import base64
    import binascii

    try:
        decoded = base64.b64decode(cred.strip() + "=" * (-len(cred.strip()) % 4)).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return "\0invalid"  # matches no user: rejected as unauthenticated
    return decoded.partition(":")[0]


def _token_ok(req: Request, token: str | None) -> bool:
    if not token:
        return True
    import hmac

    got = req.header("x-access-token")
    return bool(got) and hmac.compare_digest(got.encode(), token.encode())


def _parse_ts(value: object) -> float | None:
    """RFC 3339 timestamp (or unix seconds) → unix seconds; None if absent/invalid."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str) or not value:
        return None
    from datetime import datetime

    v = value.strip()
    # fromisoformat (3.11) takes at most 6 fractional digits; trim nanoseconds
    head, dot, frac = v.partition(".")
    if dot:
        digits = ""
        rest = frac
        while rest and rest[0].isdigit():
            digits, rest = digits + rest[0], rest[1:]
        v = head + "." + digits[:6] + rest
    try:
        return datetime.fromisoformat(v.replace("Z", "+00:00").replace("z", "+00:00")).timestamp()
    except ValueError:
        return None


class App:
    def __init__(self, state: State) -> None:
        self.state = state
        self._procs: ProcessManager | None = None
        self._fs: Filesystem | None = None
        self._methods: dict[str, Method] | None = None
        # Loopback ports made reachable on request (`POST /forward`); None outside a sandbox.
        self.forwarder: PortForwarder | None = None

    # lazily built so that start-up imports stay small
    @property
    def procs(self) -> ProcessManager:
        if self._procs is None:
            from .process import ProcessManager

            self._procs = ProcessManager(self.state)
        return self._procs

    @property
    def fs(self) -> Filesystem:
        if self._fs is None:
            from .filesystem import Filesystem

            self._fs = Filesystem(self.state)
        return self._fs

    def method(self, path: str) -> Method | None:
        if path.startswith("/process.Process/"):
            return self.procs.methods().get(path)
        if path.startswith("/filesystem.Filesystem/"):
            return self.fs.methods().get(path)
        return None

    # -- auth -----------------------------------------------------------------

    def resolve_user(self, name: str | None) -> User | None:
        """The named user (None if unknown); the default user when no name is given."""
        if not name:
            return self.state.default_user_obj()
        return self.state.users.get(name)

    def rpc_auth(self, req: Request) -> User:
        if not _token_ok(req, self.state.access_token):
            raise RPCError("unauthenticated", "invalid or missing access token")
        name = _basic_user(req)
        user = self.resolve_user(name)
        if user is None:
            raise RPCError("unauthenticated", f"invalid user: '{name}'")
        return user

    def http_auth(self, req: Request) -> None:
        if not _token_ok(req, self.state.access_token):
            raise HTTPError(401, "unauthorized access, please provide a valid access token")

    def files_user(self, req: Request) -> User:
        name = req.query.get("username")
        if name is None:
            name = _basic_user(req)
        user = self.resolve_user(name)
        if user is None:
            raise HTTPError(401, f"invalid user: '{name}'")
        return user

    # -- handlers -------------------------------------------------------------

    async def handle(self, req: Request, resp: Response) -> None:
        path = req.path
        m = req.method
        if path.startswith("/process.Process/") or path.startswith("/filesystem.Filesystem/"):
            await dispatch(req, resp, self.method(path), self.rpc_auth)
            return
        if path == "/health":
            if m not in ("GET", "HEAD"):
                raise HTTPError(405, "method not allowed")
            await resp.send(204, headers=[("Cache-Control", "no-store")])
            return
        if path == "/files":
            await self.files(req, resp)
            return
        if path == "/init":
            if m != "POST":
                raise HTTPError(405, "method not allowed")
            await self.init(req, resp)
            return
        if path == "/envs":
            if m != "GET":
                raise HTTPError(405, "method not allowed")
            self.http_auth(req)
            await resp.send_json(200, self.state.env_vars)
            return
        if path == "/metrics":
            if m != "GET":
                raise HTTPError(405, "method not allowed")
            self.http_auth(req)
            from .metrics import collect

            await resp.send_json(200, await collect())
            return
        if path == "/sync":
            # What the sandbox wrote, flushed to its files on the host (before the node
            # reads them: a diff, an apply) without a process spawn.
            if m != "POST":
                raise HTTPError(405, "method not allowed")
            self.http_auth(req)
            await asyncio.to_thread(os.sync)
            await resp.send_json(200, {"synced": True})
            return
        if path == "/tree":
            if m != "POST":
                raise HTTPError(405, "method not allowed")
            self.http_auth(req)
            import tarfile

            from .unpack import unpack

            try:
                unpacked = await unpack(req.body)
            except (OSError, ValueError, tarfile.TarError) as e:
                raise HTTPError(400, f"could not apply the files: {e}") from None
            await resp.send_json(200, unpacked)
            return
        if path == "/oom":
            if m != "POST":
                raise HTTPError(405, "method not allowed")
            self.http_auth(req)
            force = req.query.get("force") == "1"
            await resp.send_json(200, await kill_largest(force=force))
            return
        if path == "/forward":
            if m != "POST":
                raise HTTPError(405, "method not allowed")
            self.http_auth(req)
            try:
                port = int(req.query.get("port", ""))
            except ValueError:
                raise HTTPError(400, "port must be an integer") from None
            done = self.forwarder is not None and await self.forwarder.forward(port)
            await resp.send_json(200, {"forwarded": done})
            return
        if path == "/logs":
            if m != "GET":
                raise HTTPError(405, "method not allowed")
            self.http_auth(req)
            from . import journal

            try:
                after = int(req.query.get("after", "0"))
            except ValueError:
                raise HTTPError(400, "after must be an integer") from None
            await resp.send_json(200, journal.since(after))
            return
        raise HTTPError(404, f"no route for {m} {path}")

    async def files(self, req: Request, resp: Response) -> None:
        from . import files

        if req.method == "GET":
            op = "read"
        elif req.method == "POST":
            op = "write"
        else:
            raise HTTPError(405, "method not allowed")
        files.check_file_auth(req, self.state, op)
        user = self.files_user(req)
        if op == "read":
            await files.download(req, resp, user)
        else:
            await files.upload(req, resp, user, self.fs.meta)

    async def init(self, req: Request, resp: Response) -> None:
        st = self.state
        if st.access_token and not _token_ok(req, st.access_token):
            raise HTTPError(401, "unauthorized access, please provide the current access token")
        raw = await req.body.read_all(MAX_INIT_BODY)
        body: object = {}
        if raw.strip():
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise HTTPError(400, f"invalid JSON: {e}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "body must be a JSON object")
        ts = _parse_ts(body.get("timestamp"))
        if ts is not None and st.last_init_ts is not None and ts < st.last_init_ts:
            # A stale /init (older than the last applied one) is ignored.
            await resp.send(204, headers=[("Cache-Control", "no-store")])
            return
        env_vars = body.get("envVars")
        if env_vars is not None and (
            not isinstance(env_vars, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items())
        ):
            raise HTTPError(400, "envVars must be an object of strings")
        problem = env_problem(env_vars) if env_vars is not None else None
        if problem:
            raise HTTPError(400, problem)
        user = body.get("defaultUser")
        if user is not None and (
            not isinstance(user, str) or (user and st.users.get(user) is None)
        ):
            raise HTTPError(400, f"defaultUser '{user}' does not exist")
        workdir = body.get("defaultWorkdir")
        if workdir is not None and not isinstance(workdir, str):
            raise HTTPError(400, "defaultWorkdir must be a string")
        token = body.get("accessToken")
        if token is not None and not isinstance(token, str):
            raise HTTPError(400, "accessToken must be a string")
        sandbox_id = body.get("sandboxID")  # aenv's own field (E2B's envd has none)
        if sandbox_id is not None and not isinstance(sandbox_id, str):
            raise HTTPError(400, "sandboxID must be a string")

        if env_vars is not None:
            st.env_vars = dict(env_vars)
        if user is not None:
            st.default_user = user or None
        if workdir is not None:
            st.default_workdir = workdir or None
        if token is not None:
            st.access_token = token or None
        if ts is not None:
            st.last_init_ts = ts
        if sandbox_id and sandbox_id != st.sandbox_id:
            # A new sandbox (fresh, or restored from a snapshot or a fork): its own
            # machine-id, boot id and randomness, before it runs anything of the user's.
            st.sandbox_id = sandbox_id
            if identity.ENABLED:
                for problem in identity.renew():
                    log(f"identity: {problem}")
        await resp.send(204, headers=[("Cache-Control", "no-store")])


async def serve(host: str, port: int, state: State | None = None) -> None:
    app = App(state or State.from_environ())

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve_connection(reader, writer, app.handle)

    # A reader's buffer may hold 2 × `limit` before the socket is paused: the default
    # (64 KiB) made an upload a hundred event-loop turns per 10 MiB.
    server = await asyncio.start_server(
        on_conn, host, port, reuse_address=True, backlog=1024, limit=READ_SIZE
    )
    log(f"listening on {host}:{port}")
    sudo = None
    if os.geteuid() == 0:  # the service behind the sandbox's sudo (see sudo_service)
        from .sudo_service import start_service

        sudo = start_service(app.state)
    forwarding = None
    if os.environ.get(PORT_FORWARD_ENV) == "1":  # in a sandbox (see portfwd)
        from .portfwd import PortForwarder

        forwarder = PortForwarder(skip={port}, host=os.environ.get(FORWARD_HOST_ENV) or None)
        app.forwarder = forwarder
        forwarding = asyncio.create_task(forwarder.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        server.close()
        if forwarding is not None:
            forwarding.cancel()
        if sudo is not None:
            sudo.close()
        if app._procs is not None:
            for proc in list(app._procs.procs.values()):
                proc.signal(signal.SIGKILL)


def run(host: str, port: int) -> None:
    asyncio.run(serve(host, port))
