"""Entry point: ``python -m aenv_envd --port 49983`` (or ``python -m aenv.envd``).

Arguments: ``--port N`` (default 49983, or ``$AENV_ENVD_PORT``) and
``--host H`` (default 0.0.0.0, or ``$AENV_ENVD_HOST``).

When started as PID 1 (the first process of a container), it forks: the parent
stays PID 1, reaps every zombie (orphans are re-parented to it) and forwards
SIGTERM/SIGINT/SIGHUP to the child, which runs the server. The parent exits
with the child's status. ``AENV_ENVD_NO_REAPER=1`` disables the fork.

The sudo service (``sudo_service``) listens on ``$AENV_ENVD_SUDO_SOCKET``, which defaults
to ``/run/aenv/sudo.sock`` only in a sandbox (PID 1 from the runtime bundle); likewise the
forwarding of loopback-only ports (``portfwd``, ``AENV_ENVD_PORT_FORWARD=1``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

USAGE = "usage: python -m aenv_envd [--host HOST] [--port PORT]\n"


def parse_args(argv: list[str]) -> tuple[str, int]:
    host = os.environ.get("AENV_ENVD_HOST", "0.0.0.0")
    # A literal, not aenv.domain.ENVD_PORT: this agent is stdlib-only and shipped into the
    # sandbox without the rest of aenv.
    port_s = os.environ.get("AENV_ENVD_PORT", "49983")
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            sys.stdout.write(USAGE)
            raise SystemExit(0)
        name, eq, value = a.partition("=")
        if name in ("--port", "--host"):
            if not eq:
                i += 1
                if i >= len(argv):
                    sys.stderr.write(USAGE)
                    raise SystemExit(2)
                value = argv[i]
            if name == "--port":
                port_s = value
            else:
                host = value
        else:
            sys.stderr.write(f"envd: unknown argument {a!r}\n" + USAGE)
            raise SystemExit(2)
        i += 1
    try:
        port = int(port_s)
    except ValueError:
        sys.stderr.write(f"envd: bad port {port_s!r}\n")
        raise SystemExit(2) from None
    return host, port


def _reap_forever(child: int) -> None:
    """PID 1 duties: forward signals to the server child and reap zombies."""

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(OSError):
            os.kill(child, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(0)
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)


def _is_sandbox_init() -> bool:
    """PID 1 started from the runtime bundle (not a test or a developer's shell)."""
    return os.getpid() == 1 and os.path.isfile(os.path.join(sys.prefix, "bundle.json"))


def main(argv: list[str] | None = None) -> None:
    host, port = parse_args(sys.argv[1:] if argv is None else argv)
    from .sudo_protocol import DEFAULT_SOCKET, SOCKET_ENV

    if _is_sandbox_init():  # the sudo service and port forwarding: on in sandboxes only
        from .procfs import prepare_proc

        prepare_proc()  # before any fork: the children inherit the dropped capability
        from . import identity

        identity.ENABLED = True  # the /init of a new sandbox renews its identity
        os.environ.setdefault(SOCKET_ENV, DEFAULT_SOCKET)
        os.environ.setdefault("AENV_ENVD_PORT_FORWARD", "1")
    if os.getpid() == 1 and os.environ.get("AENV_ENVD_NO_REAPER") != "1":
        child = os.fork()
        if child > 0:
            _reap_forever(child)
            return
    from .server import run

    with contextlib.suppress(KeyboardInterrupt):
        run(host, port)


if __name__ == "__main__":
    main()
