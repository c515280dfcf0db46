"""envd over raw HTTP (httpx), its basic endpoints and process.Process: health, metrics, logs;
starting processes, their output, env, cwd and user, errors, signals, stdin, deadlines,
keepalives, a pty session. Filesystem and /files are in test_envd_http_files.py, auth and
/init in test_envd_http_auth.py; the wire helpers in tests/unit/envd_http_wire.py.
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import wait_until
from tests.unit.envd_http_wire import (
    STREAM,
    UNARY,
    Stream,
    bash,
    basic,
    envelope,
    output,
    parse_envelopes,
    rpc,
    run,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="envd tests run as root")


@pytest.fixture(scope="module")
def url(envd_launcher: Callable[..., str]) -> str:
    return envd_launcher()


@pytest.fixture()
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=20) as c:
        yield c


# ---- basic endpoints ----------------------------------------------------------


def test_health_and_unknown_route(client: httpx.Client) -> None:
    r = client.get("/health")
    assert r.status_code == 204 and r.content == b""
    r = client.get("/nope")
    assert r.status_code == 404
    assert r.json()["code"] == 404


def test_metrics(client: httpx.Client) -> None:
    m = client.get("/metrics").json()
    for key in (
        "ts",
        "cpu_count",
        "cpu_used_pct",
        "mem_total",
        "mem_used",
        "mem_cache",
        "mem_total_mib",
        "mem_used_mib",
        "disk_used",
        "disk_total",
    ):
        assert key in m
    assert m["cpu_count"] >= 1 and m["mem_total"] > m["mem_used"] > 0
    assert m["disk_total"] >= m["disk_used"] >= 0
    assert abs(m["ts"] - time.time()) < 5


def test_logs_journal_processes_and_their_exit(client: httpx.Client) -> None:
    before = client.get("/logs").json()["seq"]
    events, _ = run(client, bash("exit 4", tag="journal-test"))
    pid = events[0]["start"]["pid"]
    body = client.get("/logs", params={"after": before}).json()
    mine = [e for e in body["entries"] if e["fields"].get("pid") == str(pid)]
    assert [e["message"] for e in mine] == ["process started", "process ended"]
    started, ended = mine
    assert started["fields"]["cmd"] == "/bin/bash" and started["fields"]["tag"] == "journal-test"
    assert ended["fields"]["exitCode"] == "4" and ended["level"] == "warn"
    assert body["seq"] >= ended["seq"] > started["seq"] > before
    assert client.get("/logs", params={"after": body["seq"]}).json()["entries"] == []
    assert client.get("/logs", params={"after": "x"}).status_code == 400


# ---- process.Process -----------------------------------------------------------


def test_start_stdout_stderr_exit(client: httpx.Client) -> None:
    events, eos = run(client, bash("echo out; echo err >&2; exit 3"))
    assert eos == {}
    assert "pid" in events[0]["start"] and events[0]["start"]["pid"] > 0
    assert output(events, "stdout") == b"out\n"
    assert output(events, "stderr") == b"err\n"
    assert events[-1]["end"] == {
        "exitCode": 3,
        "exited": True,
        "status": "exit status 3",
        "error": "exit status 3",
    }


def test_start_success_and_ordering(client: httpx.Client) -> None:
    events, _ = run(client, bash("for i in $(seq 1 3000); do echo line$i; done"))
    text = output(events, "stdout").decode()
    assert text == "".join(f"line{i}\n" for i in range(1, 3001))
    assert events[-1]["end"]["exitCode"] == 0
    assert "error" not in events[-1]["end"]


def test_large_output_with_slow_reader(client: httpx.Client) -> None:
    # ~24 MiB of output: more than the per-subscriber high-water mark, so reading
    # pauses while the client is not consuming, and resumes without loss.
    cmd = "head -c 18000000 /dev/zero | tr '\\0' 'a'; echo; echo tail"
    with client.stream(
        "POST", "/process.Process/Start", content=envelope(bash(cmd)), headers=STREAM
    ) as resp:
        ev = Stream(resp).events()
        next(ev)
        # The stall is the case: a client that reads nothing for a while (the process writes
        # meanwhile, past the high-water mark; no event marks "not read for a while").
        time.sleep(1.0)
        total = 0
        tail = b""
        end = None
        for m in ev:
            e = m["event"]
            if "data" in e:
                chunk = base64.b64decode(e["data"]["stdout"])
                total += len(chunk)
                tail = (tail + chunk)[-16:]
            elif "end" in e:
                end = e["end"]
    assert total == 18000000 + len("\ntail\n")
    assert tail.endswith(b"a\ntail\n") and end is not None and end["exitCode"] == 0


def test_env_cwd_and_defaults(client: httpx.Client, tmp_path: Path) -> None:
    events, _ = run(
        client,
        bash('echo "$FOO|$PWD|$HOME|$USER|$LOGNAME"', envs={"FOO": "bar"}, cwd=str(tmp_path)),
    )
    assert output(events, "stdout").decode().strip() == f"bar|{tmp_path}|/root|root|root"
    # stdin false -> /dev/null
    events, _ = run(client, bash("cat; echo done"))
    assert output(events, "stdout") == b"done\n"


def test_start_errors(client: httpx.Client) -> None:
    events, eos = run(client, bash("true", cwd="/does/not/exist"))
    assert events == [] and eos["error"]["code"] == "invalid_argument"
    events, eos = run(client, {"process": {"cmd": "/no/such/binary"}})
    assert eos["error"]["code"] == "invalid_argument"
    events, eos = run(client, bash("true"), basic("no-such-user"))
    assert eos["error"]["code"] == "unauthenticated"


@pytest.mark.parametrize(
    "envs, needle",
    [
        ({"A=B": "x"}, "'='"),
        ({"": "x"}, "empty"),
        ({"A\0B": "x"}, "NUL"),
        ({"A": "x\0y"}, "NUL"),
        ({"BIG": "x" * (64 << 10)}, "bytes"),
    ],
)
def test_start_refuses_envs_no_process_could_have(
    client: httpx.Client, envs: dict[str, str], needle: str
) -> None:
    events, eos = run(client, bash("echo ran", envs=envs))
    assert events == []
    assert eos["error"]["code"] == "invalid_argument" and needle in eos["error"]["message"]
    # The next command is unaffected.
    events, _ = run(client, bash("echo fine"))
    assert output(events, "stdout") == b"fine\n"


def test_start_nul_in_args_and_huge_args_are_invalid_argument(client: httpx.Client) -> None:
    _, eos = run(client, bash("echo a\0b"))
    assert eos["error"]["code"] == "invalid_argument"
    # Past the kernel's per-string bound (128 KiB): E2BIG from execve.
    _, eos = run(client, bash("true", args=["-c", "true", "x" * (200 << 10)]))
    assert eos["error"]["code"] == "invalid_argument"


def test_run_as_other_user(client: httpx.Client) -> None:
    events, _ = run(client, bash("id -u; echo $HOME; pwd"), basic("nobody"))
    uid, home, cwd = output(events, "stdout").decode().split("\n")[:3]
    assert uid == "65534"
    assert home == "/nonexistent" and cwd == "/"  # home does not exist -> /


def test_signal_kill_and_connect(client: httpx.Client) -> None:
    with client.stream(
        "POST",
        "/process.Process/Start",
        content=envelope(bash("echo ready; sleep 30", tag="sleeper")),
        headers=STREAM,
    ) as resp:
        s = Stream(resp)
        ev = s.events()
        pid = next(ev)["event"]["start"]["pid"]
        assert base64.b64decode(next(ev)["event"]["data"]["stdout"]) == b"ready\n"

        procs = rpc(client, "process.Process/List", {}).json()["processes"]
        mine = [p for p in procs if p["pid"] == pid]
        assert mine and mine[0]["tag"] == "sleeper"
        assert mine[0]["config"]["cmd"] == "/bin/bash"

        # a second consumer attaches by tag
        with client.stream(
            "POST",
            "/process.Process/Connect",
            content=envelope({"process": {"tag": "sleeper"}}),
            headers=STREAM,
        ) as resp2:
            s2 = Stream(resp2)
            ev2 = s2.events()
            assert next(ev2)["event"]["start"]["pid"] == pid
            r = rpc(
                client,
                "process.Process/SendSignal",
                {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"},
            )
            assert r.status_code == 200 and r.json() == {}
            end2 = [e for e in ev2 if "event" in e and "end" in e["event"]]
        end = [e for e in ev if "event" in e and "end" in e["event"]]
    for e in (end, end2):
        assert e[0]["event"]["end"] == {
            "exitCode": -1,
            "exited": False,
            "status": "signal: killed",
            "error": "signal: killed",
        }
    r = rpc(client, "process.Process/SendSignal", {"process": {"pid": pid}, "signal": 9})
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = client.post(
        "/process.Process/Connect", content=envelope({"process": {"pid": pid}}), headers=STREAM
    )
    assert parse_envelopes(r.content) == [
        (2, {"error": {"code": "not_found", "message": f"process with pid {pid} not found"}})
    ]


def test_stdin_send_and_close(client: httpx.Client) -> None:
    msg = {"process": {"cmd": "/bin/cat"}, "stdin": True}
    with client.stream(
        "POST", "/process.Process/Start", content=envelope(msg), headers=STREAM
    ) as resp:
        ev = Stream(resp).events()
        pid = next(ev)["event"]["start"]["pid"]
        for chunk in (b"hello ", b"world\n"):
            r = rpc(
                client,
                "process.Process/SendInput",
                {"process": {"pid": pid}, "input": {"stdin": base64.b64encode(chunk).decode()}},
            )
            assert r.status_code == 200
        r = rpc(client, "process.Process/CloseStdin", {"process": {"pid": pid}})
        assert r.status_code == 200
        events = [e["event"] for e in ev]
    assert output(events, "stdout") == b"hello world\n"
    assert events[-1]["end"]["exitCode"] == 0


def test_stdin_absent_means_pipe_and_stream_input(client: httpx.Client) -> None:
    # StartRequest without "stdin" keeps a stdin pipe (envd compatibility)
    with client.stream(
        "POST",
        "/process.Process/Start",
        content=envelope({"process": {"cmd": "/bin/cat"}}),
        headers=STREAM,
    ) as resp:
        ev = Stream(resp).events()
        pid = next(ev)["event"]["start"]["pid"]

        def body() -> Iterator[bytes]:
            yield envelope({"start": {"process": {"pid": pid}}})
            yield envelope({"keepalive": {}})
            for part in (b"a", b"b", b"c\n"):
                yield envelope({"data": {"input": {"stdin": base64.b64encode(part).decode()}}})

        r = client.post("/process.Process/StreamInput", content=body(), headers=STREAM)
        assert parse_envelopes(r.content) == [(0, {}), (2, {})]
        rpc(client, "process.Process/CloseStdin", {"process": {"pid": pid}})
        events = [e["event"] for e in ev]
    assert output(events, "stdout") == b"abc\n"


def test_deadline_kills_process(client: httpx.Client) -> None:
    events, eos = run(
        client, bash("echo x; sleep 20", tag="deadline"), {"connect-timeout-ms": "500"}
    )
    assert eos["error"]["code"] == "deadline_exceeded"

    def tagged() -> list[dict[str, Any]]:
        procs = rpc(client, "process.Process/List", {}).json()["processes"]
        return [p for p in procs if p.get("tag") == "deadline"]

    wait_until(lambda: not tagged(), 10, 0.05, "the process past its deadline to be gone")
    # unary deadline
    r = client.post(
        "/process.Process/List", json={}, headers={**UNARY, "connect-timeout-ms": "5000"}
    )
    assert r.status_code == 200


def test_keepalive(client: httpx.Client) -> None:
    events, _ = run(client, bash("sleep 1.3; echo done"), {"keepalive-ping-interval": "0.4"})
    assert sum(1 for e in events if "keepalive" in e) >= 2
    assert output(events, "stdout") == b"done\n"


def test_pty_session(client: httpx.Client) -> None:
    msg = {
        "process": {"cmd": "/bin/bash", "args": ["-i"], "envs": {"TERM": "xterm-256color"}},
        "pty": {"size": {"cols": 100, "rows": 30}},
    }
    with client.stream(
        "POST", "/process.Process/Start", content=envelope(msg), headers=STREAM
    ) as resp:
        ev = Stream(resp).events()
        pid = next(ev)["event"]["start"]["pid"]
        r = rpc(
            client,
            "process.Process/Update",
            {"process": {"pid": pid}, "pty": {"size": {"cols": 120, "rows": 40}}},
        )
        assert r.status_code == 200
        line = b"stty size; tty; echo $TERM; exit 7\n"
        r = rpc(
            client,
            "process.Process/SendInput",
            {"process": {"pid": pid}, "input": {"pty": base64.b64encode(line).decode()}},
        )
        assert r.status_code == 200
        events = [e["event"] for e in ev]
    out = output(events, "pty")
    assert b"40 120" in out
    assert b"/dev/pts/" in out
    assert b"xterm-256color" in out
    assert events[-1]["end"]["exitCode"] == 7
    assert output(events, "stdout") == b""


def test_unary_errors(client: httpx.Client) -> None:
    r = rpc(client, "process.Process/Nope", {})
    assert r.status_code == 501 and r.json()["code"] == "unimplemented"
    r = client.post("/process.Process/List", content=b"{bad", headers=UNARY)
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    r = rpc(client, "process.Process/SendInput", {"process": {"tag": "none"}, "input": {}})
    assert r.status_code == 404 and r.json()["code"] == "not_found"
