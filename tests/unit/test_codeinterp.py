"""The code interpreter's pure parts: NDJSON events as the stock SDK parses them, Jupyter
message → event mapping, per-run environment code; and a bash context on the host's bash."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from e2b_code_interpreter.models import Execution, parse_output

from aenv.codeinterp import events
from aenv.codeinterp.bashctx import BashContext
from aenv.codeinterp.server import Interpreter
from aenv.envd.httpserver import serve_connection


def _msg(kind: str, content: dict[str, object], parent: str = "m1") -> dict[str, object]:
    return {
        "header": {"msg_type": kind, "date": datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)},
        "parent_header": {"msg_id": parent},
        "content": content,
    }


def _sdk(lines: list[bytes]) -> Execution:
    """What the stock SDK makes of the lines (its own parser)."""
    ex = Execution()
    for line in lines:
        assert line.endswith(b"\n") and b"\n" not in line[:-1]
        parse_output(ex, line.decode())
    return ex


def test_ndjson_is_one_utf8_line_per_event() -> None:
    line = events.ndjson(events.stream("stdout", "é\nnext\n"))
    assert line.count(b"\n") == 1 and "é".encode() in line
    assert json.loads(line)["text"] == "é\nnext\n"


def test_an_execution_as_the_sdk_sees_it() -> None:
    t = events.Tracker("m1")
    msgs = [
        _msg("status", {"execution_state": "busy"}),
        _msg("execute_input", {"code": "x", "execution_count": 7}),
        _msg("stream", {"name": "stdout", "text": "out\n"}),
        _msg("stream", {"name": "stdout", "text": "ignored"}, parent="other"),
        _msg("stream", {"name": "stderr", "text": "err\n"}),
        _msg("display_data", {"data": {"text/plain": "<Figure>", "image/png": "iVBO"}}),
        _msg("execute_result", {"data": {"text/plain": "'abc'", "text/html": "<i>abc</i>"}}),
    ]
    lines = [events.ndjson(ev) for m in msgs for ev in t.feed(m)]
    assert not t.done
    assert t.feed(_msg("status", {"execution_state": "idle"})) == []
    assert t.done
    ex = _sdk([*lines, events.ndjson(events.end())])
    assert ex.execution_count == 7
    assert "".join(ex.logs.stdout) == "out\n" and "".join(ex.logs.stderr) == "err\n"
    assert [r.is_main_result for r in ex.results] == [False, True]
    assert ex.results[0].png == "iVBO"
    # A str's repr keeps no quotes, as on E2B.
    assert ex.text == "abc" and ex.results[1].html == "<i>abc</i>"
    assert ex.error is None
    assert json.loads(lines[1])["timestamp"] == "2026-01-02T03:04:05+00:00"


def test_an_error_keeps_name_value_and_a_plain_traceback() -> None:
    t = events.Tracker("m1")
    tb = ["\x1b[0;31mNameError\x1b[0m  Traceback", "----> 1 \x1b[43mnope\x1b[0m"]
    evs = t.feed(_msg("error", {"ename": "NameError", "evalue": "name 'nope'", "traceback": tb}))
    evs += t.feed(_msg("error", {"ename": "Again", "evalue": "", "traceback": []}))
    ex = _sdk([events.ndjson(e) for e in evs])
    assert ex.error is not None
    assert (ex.error.name, ex.error.value) == ("NameError", "name 'nope'")
    assert ex.error.traceback == "NameError  Traceback\n----> 1 nope"


def test_unknown_mime_types_go_to_extra() -> None:
    ev = events.result({"text/plain": "t", "application/vnd.custom+json": {"a": 1}}, False)
    assert ev["extra"] == {"application/vnd.custom+json": {"a": 1}}
    (res,) = _sdk([events.ndjson(ev)]).results
    assert res.text == "t" and "application/vnd.custom+json" in res.formats()


def test_idle_before_busy_is_not_the_end() -> None:
    t = events.Tracker("m1")
    t.feed(_msg("status", {"execution_state": "idle"}))
    assert not t.done


@pytest.mark.parametrize(
    ("given", "want"),
    [(None, "python"), ("Python", "python"), ("py", "python"), ("sh", "bash"), ("r", "r")],
)
def test_languages(given: str | None, want: str) -> None:
    assert events.normalize_language(given) == want


def test_env_vars_checked() -> None:
    assert events.check_envs(None) == {}
    assert events.check_envs({"A_1": "x y"}) == {"A_1": "x y"}
    for bad in ({"1A": "x"}, {"A=B": "x"}, {"A": 1}, {"A": "a\0b"}, ["A"]):
        with pytest.raises(ValueError):
            events.check_envs(bad)


def test_python_env_push_and_pop_restore_the_environment() -> None:
    code = (
        "import os\nos.environ['KEEP'] = 'old'\nos.environ.pop('NEW', None)\n"
        + events.python_env_push({"KEEP": "new", "NEW": "it's"})
        + "print(os.environ['KEEP'], os.environ['NEW'])\n"
        + events.python_env_pop()
        + "print(os.environ['KEEP'], os.environ.get('NEW'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "new it's\nold None\n"


def test_bash_script_sets_envs_for_one_run(tmp_path: Path) -> None:
    code = tmp_path / "code.sh"
    code.write_text('echo "$KEEP $NEW"; X=1; false\n')
    script = (
        "KEEP=old\n"
        + events.bash_script(str(code), {"KEEP": "new", "NEW": "it's"}, "MARK")
        + 'echo "after: $KEEP ${NEW:-unset} $X"\n'
    )
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout == "new it's\nMARK 1\nafter: old unset 1\n"
    assert out.stderr == "MARK\n"


async def _run(ctx: BashContext, code: str, envs: dict[str, str] | None = None) -> Execution:
    return _sdk([events.ndjson(ev) async for ev in ctx.execute(code, envs or {})])


async def test_bash_context_keeps_state_and_streams(tmp_path: Path) -> None:
    ctx = BashContext("c1", str(tmp_path), dict(os.environ), str(tmp_path))
    await ctx.start()
    try:
        first = await _run(ctx, "V=7; cd /; printf 'no newline'")
        assert "".join(first.logs.stdout) == "no newline" and first.error is None
        second = await _run(ctx, "echo $V $(pwd); echo warn >&2; (exit 3)")
        assert "".join(second.logs.stdout) == "7 /\n" and "".join(second.logs.stderr) == "warn\n"
        assert second.error is not None and second.error.value == "3"
        assert second.execution_count == 2
        # `exit` ends the shell: reported, and the context starts afresh.
        gone = await _run(ctx, "echo bye; exit 5")
        assert "".join(gone.logs.stdout) == "bye\n"
        assert gone.error is not None and gone.error.name == "ContextRestarting"
        again = await _run(ctx, "echo ${V:-unset}")
        assert "".join(again.logs.stdout) == "unset\n" and again.error is None
    finally:
        await ctx.close()


@contextlib.asynccontextmanager
async def interp_url(tmp_path: Path) -> AsyncIterator[str]:
    """The server's routes on a loopback port (bash contexts only: no Jupyter here), on the
    test's own event loop."""
    interp = Interpreter(str(tmp_path), str(tmp_path))

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await serve_connection(r, w, interp.handle)

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for cid in list(interp.contexts):
            await interp.remove(cid)


async def _post_execute(c: httpx.AsyncClient, body: dict[str, object]) -> Execution:
    r = await c.post("/execute", json=body)
    assert r.status_code == 200, r.text
    return _sdk([line.encode() + b"\n" for line in r.text.splitlines()])


async def test_routes_with_a_bash_context(tmp_path: Path) -> None:
    async with interp_url(tmp_path) as url, httpx.AsyncClient(base_url=url, timeout=60) as c:
        assert (await c.get("/health")).status_code == 200
        r = await c.post("/contexts", json={"language": "bash", "cwd": str(tmp_path)})
        ctx = r.json()
        assert r.status_code == 200 and ctx["language"] == "bash" and ctx["cwd"] == str(tmp_path)
        ex = await _post_execute(
            c, {"code": "echo $PWD $ONLY", "context_id": ctx["id"], "env_vars": {"ONLY": "x"}}
        )
        assert "".join(ex.logs.stdout) == f"{tmp_path} x\n"
        assert [x["id"] for x in (await c.get("/contexts")).json()] == [ctx["id"]]
        for body, status in [
            ({"code": "1", "context_id": ctx["id"], "language": "bash"}, 400),
            ({"code": "1", "language": "r"}, 400),
            ({"code": "1", "context_id": "nope"}, 404),
            ({"code": 1}, 400),
            ({"code": "1", "language": "bash", "env_vars": {"1X": "y"}}, 400),
        ]:
            r = await c.post("/execute", json=body)
            assert r.status_code == status and r.json()["code"] == status, (body, r.text)
        assert (await c.post(f"/contexts/{ctx['id']}/restart")).status_code == 204
        assert (await c.delete(f"/contexts/{ctx['id']}")).status_code == 204
        assert (await c.delete(f"/contexts/{ctx['id']}")).status_code == 404
        assert (await c.get("/contexts")).json() == []


async def test_a_caller_that_goes_away_stops_its_code(tmp_path: Path) -> None:
    async with interp_url(tmp_path) as url, httpx.AsyncClient(base_url=url, timeout=60) as c:
        body = {"code": "echo started; sleep 600", "language": "bash"}
        async with c.stream("POST", "/execute", json=body) as r:
            async for line in r.aiter_lines():
                if "started" in line:
                    break
        # Without the interrupt this would wait behind the sleep (the context's lock).
        after = await _post_execute(c, {"code": "echo after", "language": "bash"})
        assert "".join(after.logs.stdout) == "after\n"
