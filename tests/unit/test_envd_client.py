"""The node's envd client (`orchestrator/envd_client.py`) over a mock transport: the requests
it sends and how it reads streams, ends and errors (the wire format: test_envd_wire.py)."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from aenv.envd_wire import FLAG_END_STREAM, EnvelopeDecoder, b64encode, encode_envelope
from aenv.orchestrator.envd_client import EnvdRpc, ProcessEvent, SandboxProcessError

Handler = Callable[[httpx.Request], httpx.Response]


def _rpc(handler: Handler) -> tuple[EnvdRpc, httpx.AsyncClient]:
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return EnvdRpc(http, "10.0.0.2", 49983, "tok"), http


def _stream(*messages: dict[str, object], end: dict[str, object] | None = None) -> bytes:
    return b"".join(encode_envelope(m) for m in messages) + encode_envelope(
        end or {}, FLAG_END_STREAM
    )


async def test_run_sends_a_start_request_and_returns_the_end() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = _stream(
            {"event": {"start": {"pid": 9}}},
            {"event": {"data": {"stdout": b64encode(b"out\n")}}},
            {"event": {"keepalive": {}}},
            {"event": {"data": {"stderr": b64encode(b"err\n")}}},
            {"event": {"end": {"exitCode": 2, "exited": True, "status": "exit status 2"}}},
        )
        return httpx.Response(200, content=body)

    rpc, http = _rpc(handler)
    out: list[tuple[str, bytes]] = []
    end = await rpc.run(
        "/bin/sh",
        ["-c", "x"],
        user="user",
        envs={"A": "1"},
        cwd="/w",
        timeout=1.5,
        on_output=lambda kind, data: out.append((kind, data)),
    )
    await http.aclose()
    assert end == ProcessEvent("end", exit_code=2, exited=True, status="exit status 2")
    assert out == [("stdout", b"out\n"), ("stderr", b"err\n")]
    req = seen[0]
    assert str(req.url) == "http://10.0.0.2:49983/process.Process/Start"
    assert req.headers["content-type"] == "application/connect+json"
    assert req.headers["connect-protocol-version"] == "1"
    assert req.headers["connect-timeout-ms"] == "1500"
    assert req.headers["x-access-token"] == "tok"
    assert req.headers["authorization"] == "Basic " + b64encode(b"user:")
    (envelope,) = EnvelopeDecoder().feed(req.content)
    assert json.loads(envelope.payload) == {
        "process": {"cmd": "/bin/sh", "args": ["-c", "x"], "envs": {"A": "1"}, "cwd": "/w"}
    }


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (
            httpx.Response(
                200, content=_stream(end={"error": {"code": "internal", "message": "boom"}})
            ),
            "boom",
        ),
        (
            httpx.Response(401, json={"code": "unauthenticated", "message": "bad token"}),
            "bad token",
        ),
        (httpx.Response(200, content=_stream({"event": {"start": {"pid": 1}}})), "without an end"),
    ],
)
async def test_run_failures_are_sandbox_process_errors(
    response: httpx.Response, message: str
) -> None:
    rpc, http = _rpc(lambda request: response)
    with pytest.raises(SandboxProcessError) as exc:
        await rpc.run("true", [])
    await http.aclose()
    assert message in str(exc.value)


async def test_make_dir_already_exists_and_errors() -> None:
    answers = iter(
        [
            httpx.Response(200, json={}),
            httpx.Response(409, json={"code": "already_exists", "message": "exists"}),
            httpx.Response(403, json={"code": "permission_denied", "message": "no"}),
        ]
    )
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return next(answers)

    rpc, http = _rpc(handler)
    assert await rpc.make_dir("/a", user="user") is True
    assert await rpc.make_dir("/a") is False
    with pytest.raises(SandboxProcessError, match="no"):
        await rpc.make_dir("/b")
    await http.aclose()
    assert seen[0].url.path == "/filesystem.Filesystem/MakeDir"
    assert seen[0].headers["content-type"] == "application/json"
    assert json.loads(seen[0].content) == {"path": "/a"}
