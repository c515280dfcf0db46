"""The envd client (`envd_client.py`) over a mock transport: the requests it sends, straight
to a sandbox or routed through the aenv server, and how it reads streams, ends and errors
(the wire format: test_envd_wire.py)."""

from __future__ import annotations

import io
import json
from collections.abc import Callable

import httpx
import pytest

from aenv.envd_client import EnvdClient, EnvdTarget, ProcessEvent
from aenv.envd_errors import EnvdError, EnvdUnreachable
from aenv.envd_wire import FLAG_END_STREAM, EnvelopeDecoder, b64encode, encode_envelope

Handler = Callable[[httpx.Request], httpx.Response]


def _rpc(handler: Handler) -> tuple[EnvdClient, httpx.AsyncClient]:
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return EnvdClient(EnvdTarget.direct("10.0.0.2", "tok", port=49983), http), http


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
async def test_run_failures_are_envd_errors(response: httpx.Response, message: str) -> None:
    rpc, http = _rpc(lambda request: response)
    with pytest.raises(EnvdError) as exc:
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
    with pytest.raises(EnvdError, match="no"):
        await rpc.make_dir("/b")
    await http.aclose()
    assert seen[0].url.path == "/filesystem.Filesystem/MakeDir"
    assert seen[0].headers["content-type"] == "application/json"
    assert json.loads(seen[0].content) == {"path": "/a"}


async def test_a_routed_target_names_the_sandbox_and_files_carry_the_user() -> None:
    """The CLI's way: every request to the server's port with the route headers, the
    token and the client's headers; `/files` with the client's user."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/files" and request.method == "GET":
            return httpx.Response(404, json={"code": 404, "message": "no such file"})
        return httpx.Response(200, json={})

    target = EnvdTarget.routed(
        "http://aenv:8000/", "sbx-a", "tok", headers={"User-Agent": "aenv-cli"}
    )
    async with EnvdClient(target, user="alice", transport=httpx.MockTransport(handler)) as envd:
        await envd.unary("process.Process/SendInput", {"process": {"pid": 1}})
        await envd.upload("/w/f", io.BytesIO(b"data"), filename="f")
        with pytest.raises(EnvdError) as exc:
            [c async for c in envd.download("/w/g")]
    assert exc.value.code == "not_found" and exc.value.http_status == 404
    assert str(exc.value) == "/w/g: no such file"
    for req in seen:
        assert req.url.host == "aenv" and req.url.port == 8000
        assert req.headers["e2b-sandbox-id"] == "sbx-a"
        assert req.headers["e2b-sandbox-port"] == "49983"
        assert req.headers["x-access-token"] == "tok"
        assert req.headers["user-agent"] == "aenv-cli"
        assert req.headers["authorization"] == "Basic " + b64encode(b"alice:")
    assert seen[1].url.params["username"] == "alice"
    assert seen[1].headers["content-type"].startswith("multipart/form-data")
    assert b'filename="f"' in seen[1].content


async def test_no_connection_is_unreachable_naming_the_far_end() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    direct = EnvdClient(EnvdTarget.direct("10.0.0.2"), transport=httpx.MockTransport(handler))
    async with direct:
        with pytest.raises(
            EnvdUnreachable, match=r"^cannot reach envd at http://10.0.0.2:49983: refused$"
        ):
            await direct.make_dir("/a")
        assert await direct.healthy() is False
