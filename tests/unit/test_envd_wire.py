"""envd's Connect wire format (`aenv.envd_wire`): envelopes, stream ends, events, errors,
headers. Pure functions, so no server: the clients that drive them over HTTP are tested in
test_cli.py, test_bench.py and the integration tests."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv import domain, envd_wire
from aenv.envd_wire import (
    FLAG_COMPRESSED,
    FLAG_END_STREAM,
    MAX_MESSAGE,
    Envelope,
    EnvelopeDecoder,
    ProcessEvent,
    StreamReader,
    WireError,
    auth_headers,
    b64decode,
    b64encode,
    call_headers,
    code_for_status,
    encode_envelope,
    error_code,
    error_from_json,
    parse_process_event,
    route_headers,
    start_request,
)

END = encode_envelope({}, FLAG_END_STREAM)


def _event(**event: Any) -> dict[str, Any]:
    return {"event": event}


# -- envelopes ---------------------------------------------------------------------------------


def test_envelope_layout() -> None:
    msg = {"event": {"start": {"pid": 7}}}
    wire = encode_envelope(msg)
    payload = json.dumps(msg, separators=(",", ":")).encode()
    assert wire == b"\x00" + struct.pack(">I", len(payload)) + payload
    assert encode_envelope({}, FLAG_END_STREAM) == b"\x02\x00\x00\x00\x02{}"


def test_envelope_roundtrip_split_anywhere() -> None:
    msgs = [_event(start={"pid": 7}), _event(data={"stdout": "aGk="})]
    wire = b"".join(encode_envelope(m) for m in msgs) + END
    for cut in range(len(wire) + 1):
        dec = EnvelopeDecoder()
        got = dec.feed(wire[:cut]) + dec.feed(wire[cut:])
        assert [e.flags for e in got] == [0, 0, FLAG_END_STREAM]
        assert [e.end_stream for e in got] == [False, False, True]
        assert [json.loads(e.payload) for e in got] == [*msgs, {}]
        assert dec.pending == 0


def test_decoder_holds_partial_frames_byte_by_byte() -> None:
    wire = encode_envelope({"a": 1}) + encode_envelope({"b": 2})
    dec = EnvelopeDecoder()
    got: list[Envelope] = []
    for i in range(len(wire)):
        got += dec.feed(wire[i : i + 1])
        assert dec.pending == (i + 1) - sum(5 + len(e.payload) for e in got)
    assert [e.payload for e in got] == [b'{"a":1}', b'{"b":2}']
    assert dec.feed(b"") == [] and dec.pending == 0


def test_decoder_rejects_an_oversized_length() -> None:
    with pytest.raises(WireError) as exc:
        EnvelopeDecoder().feed(struct.pack(">BI", 0, MAX_MESSAGE + 1))
    assert exc.value.code == "resource_exhausted"


def test_empty_payload_envelope() -> None:
    assert EnvelopeDecoder().feed(b"\x02\x00\x00\x00\x00") == [Envelope(FLAG_END_STREAM, b"")]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)
_MESSAGES = st.lists(st.dictionaries(st.text(max_size=8), _JSON, max_size=4), max_size=6)


@given(messages=_MESSAGES, cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_stream_roundtrip_property(messages: list[dict[str, Any]], cuts: list[int]) -> None:
    """Whatever the messages and wherever the transport splits the bytes, a reader gets the
    same messages back, in order, and sees the clean end."""
    wire = b"".join(encode_envelope(m) for m in messages) + END
    points = sorted({c % (len(wire) + 1) for c in cuts})
    chunks = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]
    reader = StreamReader()
    got: list[dict[str, Any]] = []
    fed = 0
    for chunk in chunks:
        got += reader.feed(chunk)
        fed += len(chunk)
        assert reader.ended == (fed == len(wire))
    assert got == messages and reader.ended


@given(data=st.binary(max_size=64))
def test_b64_roundtrip_property(data: bytes) -> None:
    text = b64encode(data)
    assert b64decode(text) == data
    assert b64decode(text.rstrip("=")) == data
    assert b64decode(base64.urlsafe_b64encode(data).decode()) == data


# -- stream ends -------------------------------------------------------------------------------


def test_stream_reader_clean_end_and_nothing_after() -> None:
    reader = StreamReader()
    msgs = reader.feed(encode_envelope(_event(start={"pid": 1})) + END + encode_envelope({"x": 1}))
    assert msgs == [_event(start={"pid": 1})] and reader.ended
    assert reader.feed(encode_envelope({"late": True})) == []


def test_stream_reader_end_with_error() -> None:
    reader = StreamReader()
    assert reader.feed(encode_envelope(_event(start={"pid": 1}))) == [_event(start={"pid": 1})]
    err = {"error": {"code": "deadline_exceeded", "message": "context deadline exceeded"}}
    wire = encode_envelope(err, FLAG_END_STREAM)
    assert reader.feed(wire[:3]) == []
    with pytest.raises(WireError) as exc:
        reader.feed(wire[3:])
    assert exc.value.code == "deadline_exceeded"
    assert exc.value.message == "context deadline exceeded"
    assert str(exc.value) == "context deadline exceeded"
    assert not reader.ended


def test_stream_reader_cut_short_is_not_ended() -> None:
    reader = StreamReader()
    wire = encode_envelope(_event(start={"pid": 1})) + END
    assert reader.feed(wire[:-1]) == [_event(start={"pid": 1})]
    assert not reader.ended


@pytest.mark.parametrize(
    ("wire", "code"),
    [
        (encode_envelope({"a": 1}, FLAG_COMPRESSED), "internal"),
        (b"\x00\x00\x00\x00\x03{x}", "internal"),
    ],
)
def test_stream_reader_rejects_broken_messages(wire: bytes, code: str) -> None:
    with pytest.raises(WireError) as exc:
        StreamReader().feed(wire)
    assert exc.value.code == code


def test_non_object_messages_read_as_empty() -> None:
    assert StreamReader().feed(b"\x00\x00\x00\x00\x02[]") == [{}]


# -- process events ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "event"),
    [
        (_event(start={"pid": 42}), ProcessEvent("start", pid=42)),
        (_event(start={}), ProcessEvent("start", pid=0)),
        (_event(data={"stdout": b64encode(b"hi\n")}), ProcessEvent("stdout", data=b"hi\n")),
        (_event(data={"stderr": "aGk"}), ProcessEvent("stderr", data=b"hi")),
        (_event(data={"pty": "-_8"}), ProcessEvent("pty", data=b"\xfb\xff")),
        (
            _event(end={"exitCode": 3, "exited": True, "status": "exit status 3"}),
            ProcessEvent("end", exit_code=3, exited=True, status="exit status 3"),
        ),
        # proto3 JSON omits zero values: an empty end is a clean exit code 0.
        (_event(end={}), ProcessEvent("end", exit_code=0)),
        (_event(end={"exitCode": "7"}), ProcessEvent("end", exit_code=7)),
        (_event(end={"exitCode": "x"}), ProcessEvent("end", exit_code=-1)),
        (
            _event(end={"exitCode": -1, "status": "signal: killed", "error": "signal: killed"}),
            ProcessEvent("end", exit_code=-1, status="signal: killed", error="signal: killed"),
        ),
    ],
)
def test_parse_process_event(message: dict[str, Any], event: ProcessEvent) -> None:
    assert parse_process_event(message) == event


@pytest.mark.parametrize(
    "message",
    [
        {},
        {"event": None},
        _event(keepalive={}),
        _event(data={}),
        _event(data={"stdout": ""}),
        _event(unknown={"x": 1}),
    ],
)
def test_events_without_content_are_none(message: dict[str, Any]) -> None:
    assert parse_process_event(message) is None


def test_malformed_base64_is_a_wire_error() -> None:
    with pytest.raises(WireError) as exc:
        parse_process_event(_event(data={"stdout": "a"}))
    assert exc.value.code == "internal"


def test_start_request() -> None:
    assert start_request("/bin/bash", ["-l", "-c", "true"]) == {
        "process": {"cmd": "/bin/bash", "args": ["-l", "-c", "true"]}
    }
    assert start_request("sh", [], envs={"A": "1"}, cwd="/tmp", stdin=True, pty_size=(80, 24)) == {
        "process": {"cmd": "sh", "args": [], "envs": {"A": "1"}, "cwd": "/tmp"},
        "stdin": True,
        "pty": {"size": {"cols": 80, "rows": 24}},
    }


# -- errors ------------------------------------------------------------------------------------


def test_error_code_prefers_a_connect_body() -> None:
    assert error_code(409, b'{"code":"already_exists","message":"x"}') == "already_exists"
    assert error_code(400, b'{"code":"not_found"}') == "not_found"
    # aenv's own error bodies carry the HTTP status as an integer code.
    assert error_code(410, b'{"code":410,"message":"sandbox is paused"}') == "failed_precondition"
    assert error_code(502, b"Bad Gateway") == "unavailable"
    assert error_code(500, b"") == "unknown"


def test_code_for_status() -> None:
    assert code_for_status(401) == "unauthenticated"
    assert code_for_status(504) == "deadline_exceeded"
    assert code_for_status(418) == "unknown"


def test_error_from_json() -> None:
    err = error_from_json({"code": "not_found", "message": "process 7 not found"})
    assert (err.code, err.message, str(err)) == ("not_found", "process 7 not found", err.message)
    assert error_from_json({"message": "m"}).code == "unknown"
    assert error_from_json("nope", "internal").code == "internal"
    assert str(error_from_json({"code": "canceled"})) == "canceled"


# -- headers -----------------------------------------------------------------------------------


def test_auth_headers() -> None:
    assert auth_headers(None) == {}
    assert auth_headers("tok") == {"X-Access-Token": "tok"}
    assert auth_headers("", "user") == {"Authorization": "Basic " + b64encode(b"user:")}


def test_call_headers() -> None:
    assert call_headers(stream=True) == {
        "Connect-Protocol-Version": "1",
        "Content-Type": "application/connect+json",
    }
    assert call_headers(stream=False, timeout_ms=1500) == {
        "Connect-Protocol-Version": "1",
        "Content-Type": "application/json",
        "Connect-Timeout-Ms": "1500",
    }


def test_route_headers_and_the_one_port() -> None:
    assert envd_wire.ENVD_PORT is domain.ENVD_PORT == 49983
    assert route_headers("sbx1") == {"E2b-Sandbox-Id": "sbx1", "E2b-Sandbox-Port": "49983"}
    assert route_headers("sbx1", 8080)["E2b-Sandbox-Port"] == "8080"
