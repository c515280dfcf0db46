"""Running things in a sandbox from the terminal: `exec` (streamed stdout/stderr) and the
interactive PTY shell of `start`/`connect`.

Both are coroutines over the one envd client, run by the command (`connect.run`): the
process stream, stdin and the calls beside it (input, resize, kill) share its loop; only
the blocking reads of local stdin have a thread of their own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import select
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO, cast

from ..envd_client import EnvdClient
from ..envd_errors import EnvdError, EnvdUnreachable
from ..envd_wire import (
    PROCESS_CLOSE_STDIN,
    PROCESS_SEND_INPUT,
    PROCESS_SEND_SIGNAL,
    PROCESS_START,
    PROCESS_UPDATE,
    ProcessEvent,
    b64encode,
    start_request,
)
from .connect import ConnectError, cli_error
from .errors import CannotInvoke, CliError, CommandNotFound

# Go's `syscall.Signal.String()` on Linux, as envd puts it in `status` ("signal: killed").
_GO_SIGNAL_NAMES = {
    "hangup": 1,
    "interrupt": 2,
    "quit": 3,
    "illegal instruction": 4,
    "trace/breakpoint trap": 5,
    "aborted": 6,
    "bus error": 7,
    "floating point exception": 8,
    "killed": 9,
    "user defined signal 1": 10,
    "segmentation fault": 11,
    "user defined signal 2": 12,
    "broken pipe": 13,
    "alarm clock": 14,
    "terminated": 15,
}
_SIGNAL_RE = re.compile(r"signal:?\s*(.+)$", re.IGNORECASE)
_EXIT_RE = re.compile(r"exit status (-?\d+)")


def signal_number(status: str) -> int | None:
    """The signal named in an end event's `status`, e.g. "signal: killed" → 9."""
    m = _SIGNAL_RE.search(status.strip())
    if not m:
        return None
    name = m.group(1).strip().rstrip(".").lower()
    if name.isdigit():
        return int(name)
    if name in _GO_SIGNAL_NAMES:
        return _GO_SIGNAL_NAMES[name]
    upper = name.upper()
    for candidate in (upper, "SIG" + upper):
        with contextlib.suppress(KeyError):
            return int(signal.Signals[candidate])
    return None


def exit_code_of(end: ProcessEvent) -> int:
    """The local exit code for a process `end` event: its exit code, 128+n for a signal,
    1 when unknown."""
    code = end.exit_code
    if end.exited and code >= 0:
        return code & 0xFF
    sig = signal_number(end.status)
    if sig is not None:
        return 128 + sig
    m = _EXIT_RE.search(end.status)
    if m:
        return int(m.group(1)) & 0xFF
    if code >= 0:
        return code & 0xFF if code or not end.error else 1
    if code < -1:  # a Popen-style -N for signal N
        return 128 + (-code)
    return 1


# How envd words a program that is not there: aenv's envd ("[Errno 2] No such file or
# directory") and E2B's Go envd ("fork/exec ...: no such file or directory", "executable
# file not found in $PATH").
_NOT_FOUND_RE = re.compile(r"no such file or directory|executable file not found", re.I)
_REFUSALS = ("invalid_argument", "permission_denied", "failed_precondition", "internal")


def invocation_error(exc: EnvdError) -> CliError:
    """envd's answer to a Start that never started, as docker tells it: the program is not
    there (127), or cannot be run, with this cwd or as this user (126). Anything else (an
    unreachable server, a sandbox gone, a refused token) is aenv's own failure (125)."""
    text = exc.message
    refused = not isinstance(exc, EnvdUnreachable) and exc.code in _REFUSALS
    if refused and re.search(r"start|spawn|exec", text, re.I) and _NOT_FOUND_RE.search(text):
        return CommandNotFound(f"{text} (command not found)", status=exc.http_status)
    if refused and (
        exc.code == "permission_denied" or re.search(r"start|spawn|cwd|user", text, re.I)
    ):
        return CannotInvoke(f"{text} (command cannot be invoked)", status=exc.http_status)
    return cli_error(exc)


def _write(stream: BinaryIO, data: bytes) -> None:
    stream.write(data)
    stream.flush()


def _binary(stream: Any) -> BinaryIO:
    buf = getattr(stream, "buffer", None)
    return cast(BinaryIO, buf if buf is not None else stream)


def _stdin_fd() -> int | None:
    try:
        return sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _read_chunks(stop: threading.Event) -> Iterator[bytes]:
    """Local stdin in chunks as they become available; stops at EOF or when `stop` is set."""
    fd = _stdin_fd()
    if fd is not None:
        while not stop.is_set():
            try:
                ready, _, _ = select.select([fd], [], [], 0.2)
            except (OSError, ValueError):
                return
            if not ready:
                continue
            try:
                data = os.read(fd, 65536)
            except OSError:
                return
            if not data:
                return
            yield data
        return
    stream = _binary(sys.stdin)
    read1 = getattr(stream, "read1", None)
    while not stop.is_set():
        data = read1(65536) if read1 is not None else stream.read(65536)
        if not data:
            return
        yield data


def _stdin_queue(stop: threading.Event) -> asyncio.Queue[bytes | None]:
    """Local stdin as a queue of chunks that ends with None, read on a daemon thread: a
    blocking read holds neither the loop nor the exit. A few chunks ahead at most, so piped
    input is not read into memory faster than it is sent."""
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=4)

    def put(item: bytes | None) -> bool:
        """Whether `item` was queued; False once the command is over."""
        putting = chunks.put(item)
        try:
            fut = asyncio.run_coroutine_threadsafe(putting, loop)
        except RuntimeError:  # the loop is closed
            putting.close()
            return False
        while not stop.is_set():
            try:
                fut.result(0.2)
                return True
            except TimeoutError:
                continue
            except concurrent.futures.CancelledError:  # the loop cancelled it on its way out
                return False
        fut.cancel()
        return False

    def pump() -> None:
        for data in _read_chunks(stop):
            if not put(data):
                return
        put(None)

    threading.Thread(target=pump, name="aenv-stdin", daemon=True).start()
    return chunks


# -- exec ---------------------------------------------------------------------------------


async def run_command(
    envd: EnvdClient,
    command: str,
    *,
    envs: dict[str, str] | None = None,
    cwd: str | None = None,
    forward_stdin: bool = False,
    timeout_ms: int | None = None,
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
) -> int:
    """Run `command` with `bash -l -c` like the SDK's `commands.run`, streaming its output
    as it arrives; returns the local exit code."""
    out = stdout or _binary(sys.stdout)
    err = stderr or _binary(sys.stderr)
    request = start_request(
        "/bin/bash", ["-l", "-c", command], envs=envs, cwd=cwd, stdin=forward_stdin
    )
    # Said either way: envd (as E2B's) keeps a process's stdin open when it is not said,
    # and a command reading it (`cat`) would wait for input that never comes.
    request["stdin"] = forward_stdin

    pid: int | None = None
    end: ProcessEvent | None = None
    stop = threading.Event()
    feeder: asyncio.Task[None] | None = None
    try:
        async with contextlib.aclosing(
            envd.events(PROCESS_START, request, timeout_ms=timeout_ms)
        ) as events:
            async for event in events:
                if event.kind == "start":
                    pid = event.pid
                    if forward_stdin and feeder is None:
                        feeder = asyncio.create_task(_feed_stdin(envd, pid, stop))
                elif event.kind == "end":
                    end = event
                else:
                    _write(err if event.kind == "stderr" else out, event.data)
    except EnvdError as exc:
        if pid is None:  # envd refused to start it: 126/127 when that is why
            raise invocation_error(exc) from None
        raise
    except (KeyboardInterrupt, asyncio.CancelledError) as exc:
        # ^C (asyncio.run cancels this task for it): the kill still goes out, 130 is the answer.
        task = asyncio.current_task()
        if isinstance(exc, asyncio.CancelledError) and task is not None:
            task.uncancel()
        stop.set()
        if pid is not None:
            with contextlib.suppress(EnvdError):
                await envd.unary(
                    PROCESS_SEND_SIGNAL, {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}
                )
        return 130
    finally:
        stop.set()
        if feeder is not None:
            feeder.cancel()
    if pid is None and end is None:
        raise CliError("the command stream ended before the process started")
    if end is None:
        raise CliError("the command ended without an end event")
    error = end.error
    # "exit status N" / "signal: killed" only restate the exit code we return.
    if error and error != end.status and not _EXIT_RE.fullmatch(error):
        print(f"aenv: {error}", file=sys.stderr)
    return exit_code_of(end)


async def _feed_stdin(envd: EnvdClient, pid: int, stop: threading.Event) -> None:
    chunks = _stdin_queue(stop)
    with contextlib.suppress(EnvdError):
        while (data := await chunks.get()) is not None:
            await envd.unary(
                PROCESS_SEND_INPUT, {"process": {"pid": pid}, "input": {"stdin": b64encode(data)}}
            )
        if not stop.is_set():
            await envd.unary(PROCESS_CLOSE_STDIN, {"process": {"pid": pid}})


# -- interactive shell --------------------------------------------------------------------


def terminal_size() -> tuple[int, int]:
    """(cols, rows) of the local terminal, else $COLUMNS/$LINES, else 80x24."""
    for stream in (sys.stdout, sys.stdin, sys.stderr):
        try:
            size = os.get_terminal_size(stream.fileno())
            if size.columns and size.lines:
                return size.columns, size.lines
        except (AttributeError, OSError, ValueError):
            continue
    size = shutil.get_terminal_size((80, 24))
    return size.columns, size.lines


class _RawMode:
    """Puts a TTY in raw mode and restores it, however the session ends."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        self._saved: list[Any] | None = None

    def __enter__(self) -> _RawMode:
        if self.fd is not None and os.isatty(self.fd):
            import termios
            import tty

            self._saved = termios.tcgetattr(self.fd)
            tty.setraw(self.fd, termios.TCSANOW)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None and self.fd is not None:
            import termios

            with contextlib.suppress(OSError):
                termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
            self._saved = None


INTERACTIVE_SHELL = ("-i", "-l")


async def attach_shell(
    envd: EnvdClient,
    *,
    args: Sequence[str] = INTERACTIVE_SHELL,
    envs: dict[str, str] | None = None,
    cwd: str | None = None,
    keepalive: Callable[[], None] | None = None,
    keepalive_interval: float = 60.0,
    forward_stdin: bool = True,
    timeout_ms: int | None = None,
) -> int:
    """`bash ARGS` (an interactive `bash -i -l` by default; `exec -t` gives `-l -c CMD`)
    on a PTY in the sandbox, wired to the local terminal.

    The local TTY (if stdin is one) is put in raw mode; keystrokes go to SendInput, window
    size changes to Update, PTY output to stdout. When stdin is not a TTY its content is
    sent as typed input followed by ^D. Without `forward_stdin` (`exec -t` without `-i`)
    nothing is typed and the terminal stays as it is. `keepalive` (a blocking call, run on
    a thread) is called every `keepalive_interval` seconds while attached (to push the
    sandbox's timeout forward). Returns the process's exit code.
    """
    cols, rows = terminal_size()
    term = os.environ.get("TERM") or "xterm-256color"
    request = start_request(
        "/bin/bash",
        list(args),
        envs={"TERM": term, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", **(envs or {})},
        cwd=cwd,
        pty_size=(cols, rows),
    )

    fd = _stdin_fd() if forward_stdin else None
    interactive = fd is not None and os.isatty(fd)
    out = _binary(sys.stdout)
    loop = asyncio.get_running_loop()
    jobs: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    stop = threading.Event()
    shown = asyncio.Event()  # the shell's first output (its prompt) arrived
    tasks: list[asyncio.Task[None]] = []
    winch_installed = False
    started = False
    end: ProcessEvent | None = None

    with _RawMode(fd if interactive else None):
        try:
            async with contextlib.aclosing(
                envd.events(PROCESS_START, request, timeout_ms=timeout_ms)
            ) as events:
                async for event in events:
                    if event.kind == "start" and not tasks:
                        if interactive and threading.current_thread() is threading.main_thread():
                            # Run on the loop, not in the signal handler: a burst of resizes
                            # only queues jobs.
                            loop.add_signal_handler(
                                signal.SIGWINCH, jobs.put_nowait, ("resize", None)
                            )
                            winch_installed = True
                        started = True
                        tasks = [
                            asyncio.create_task(
                                _pump_input(jobs, stop, interactive, shown, forward_stdin)
                            ),
                            asyncio.create_task(
                                _shell_worker(
                                    envd,
                                    event.pid,
                                    jobs,
                                    keepalive,
                                    keepalive_interval,
                                    (cols, rows),
                                )
                            ),
                        ]
                    elif event.kind == "end":
                        end = event
                    elif event.kind != "start":
                        _write(out, event.data)
                        shown.set()
        except EnvdError as exc:
            if not started:  # envd refused to start it: 126/127 when that is why
                raise invocation_error(exc) from None
            raise
        finally:
            stop.set()
            if winch_installed:
                loop.remove_signal_handler(signal.SIGWINCH)
            jobs.put_nowait(("stop", None))
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=2.0)
                for t in pending:
                    t.cancel()
    if end is None:
        raise ConnectError("unavailable", "the shell ended without an end event")
    return exit_code_of(end)


async def _pump_input(
    jobs: asyncio.Queue[tuple[str, Any]],
    stop: threading.Event,
    interactive: bool,
    shown: asyncio.Event,
    forward: bool = True,
) -> None:
    if not forward:
        return
    last = b"\n"
    if not interactive:
        # Piped input waits for the shell's first output: typed before bash's line editor
        # is up, a lone ^D (stdin from /dev/null) would be lost and the shell never exit.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(shown.wait(), 10.0)
    chunks = _stdin_queue(stop)
    while (data := await chunks.get()) is not None:
        jobs.put_nowait(("input", data))
        last = data[-1:]
    if not interactive and not stop.is_set():
        # Piped input is over: finish the line, then ^D so the shell exits.
        jobs.put_nowait(("input", (b"" if last == b"\n" else b"\n") + b"\x04"))


async def _shell_worker(
    envd: EnvdClient,
    pid: int,
    jobs: asyncio.Queue[tuple[str, Any]],
    keepalive: Callable[[], None] | None,
    interval: float,
    sent_size: tuple[int, int],
) -> None:
    selector = {"pid": pid}
    next_keepalive = time.monotonic() + interval
    while True:
        wait = max(0.0, next_keepalive - time.monotonic()) if keepalive else None
        try:
            kind, value = await asyncio.wait_for(jobs.get(), wait)
        except TimeoutError:
            with contextlib.suppress(CliError):
                if keepalive:
                    await asyncio.to_thread(keepalive)
            next_keepalive = time.monotonic() + interval
            continue
        if kind == "stop":
            return
        with contextlib.suppress(EnvdError):
            if kind == "input":
                await envd.unary(
                    PROCESS_SEND_INPUT,
                    {"process": selector, "input": {"pty": b64encode(value)}},
                )
            elif kind == "resize":
                # Read when sent: a burst of SIGWINCH while a window is dragged costs
                # one call per size actually seen, not one per signal.
                size = terminal_size()
                if size == sent_size:
                    continue
                sent_size = size
                c, r = size
                await envd.unary(
                    PROCESS_UPDATE,
                    {"process": selector, "pty": {"size": {"cols": c, "rows": r}}},
                )
