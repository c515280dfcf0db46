"""proto/*.proto match the descriptors embedded in the E2B SDK (the wire contract).

The SDK ships the serialized FileDescriptorProto of envd's protos in its
generated modules; it is decoded here with a minimal protobuf wire reader and
compared with a minimal parse of our hand-written .proto files: every message
field (name, number, label, type), enum value and RPC (with streaming flags).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto"

# FieldDescriptorProto.Type -> .proto scalar name (message/enum resolved by name)
SCALARS = {
    1: "double",
    2: "float",
    3: "int64",
    4: "uint64",
    5: "int32",
    8: "bool",
    9: "string",
    12: "bytes",
    13: "uint32",
    17: "sint32",
    18: "sint64",
}


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, Any]]:
    out: list[tuple[int, Any]] = []
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wt = key >> 3, key & 7
        val: Any
        if wt == 0:
            val, i = _varint(buf, i)
        elif wt == 2:
            n, i = _varint(buf, i)
            val, i = buf[i : i + n], i + n
        else:  # not used by descriptors we read
            raise ValueError(f"wire type {wt}")
        out.append((num, val))
    return out


def _sdk_contract(desc: bytes) -> set[tuple[str, ...]]:
    items: set[tuple[str, ...]] = set()

    def message(buf: bytes, prefix: str) -> None:
        fs = _fields(buf)
        name = prefix + next(v.decode() for n, v in fs if n == 1)
        nested_maps = set()
        for n, v in fs:
            if n == 3:
                sub = _fields(v)
                opts = [o for k, o in sub if k == 7]
                sub_name = next(x.decode() for k, x in sub if k == 1)
                if opts and any(k == 7 and x == 1 for k, x in _fields(opts[0])):
                    nested_maps.add(sub_name)
                    continue
                message(v, name + ".")
            elif n == 4:
                enum(v, name + ".")
        for n, v in fs:
            if n != 2:
                continue
            f = dict(_fields(v))
            fname, number, label, ftype = f[1].decode(), f[3], f[4], f[5]
            tname = f.get(6, b"").decode().rsplit(".", 1)[-1]
            if ftype in (11, 14):
                if tname in nested_maps:
                    items.add((name, fname, str(number), "map"))
                    continue
                tstr = tname
            else:
                tstr = SCALARS[ftype]
            lab = "repeated" if label == 3 else "optional" if f.get(17) else ""
            items.add((name, fname, str(number), lab, tstr))

    def enum(buf: bytes, prefix: str) -> None:
        fs = _fields(buf)
        name = prefix + next(v.decode() for n, v in fs if n == 1)
        for n, v in fs:
            if n == 2:
                e = dict(_fields(v))
                items.add((name, e[1].decode(), str(e.get(2, 0))))

    for n, v in _fields(desc):
        if n == 4:
            message(v, "")
        elif n == 5:
            enum(v, "")
        elif n == 6:
            svc = _fields(v)
            sname = next(x.decode() for k, x in svc if k == 1)
            for k, x in svc:
                if k == 2:
                    m = dict(_fields(x))
                    items.add(
                        (
                            "rpc " + sname,
                            m[1].decode(),
                            m[2].decode().rsplit(".", 1)[-1],
                            m[3].decode().rsplit(".", 1)[-1],
                            str(bool(m.get(5))),
                            str(bool(m.get(6))),
                        )
                    )
    return items


def _our_contract(text: str) -> set[tuple[str, ...]]:
    text = re.sub(r"//[^\n]*", "", text)
    tokens = re.findall(r"[A-Za-z_][\w.]*|\d+|[{}=;<>(),]", text)
    items: set[tuple[str, ...]] = set()
    stack: list[tuple[str, str]] = []  # (kind, name)
    i = 0

    def scope() -> str:
        return ".".join(n for k, n in stack if k in ("message", "enum"))

    while i < len(tokens):
        t = tokens[i]
        if t in ("message", "enum", "service", "oneof") and tokens[i + 2] == "{":
            stack.append((t, tokens[i + 1]))
            i += 3
        elif t == "}":
            stack.pop()
            i += 1
        elif t in ("syntax", "package", "import", "option"):
            while tokens[i] != ";":
                i += 1
            i += 1
        elif t == "rpc":
            # rpc Name ( [stream] In ) returns ( [stream] Out ) ;
            name = tokens[i + 1]
            j = i + 3
            cs = tokens[j] == "stream"
            inp = tokens[j + 1] if cs else tokens[j]
            j = tokens.index("returns", j) + 2
            ss = tokens[j] == "stream"
            out = tokens[j + 1] if ss else tokens[j]
            items.add(("rpc " + stack[-1][1], name, inp, out, str(cs), str(ss)))
            i = tokens.index(";", j) + 1
        elif stack and stack[-1][0] == "enum":
            items.add((scope(), t, tokens[i + 2]))
            i += 4
        elif t == "map":
            # map < K , V > name = N ;
            items.add((scope(), tokens[i + 6], tokens[i + 8], "map"))
            i += 10
        else:
            label = ""
            if t in ("optional", "repeated"):
                label, i = t, i + 1
            ftype, fname, number = tokens[i], tokens[i + 1], tokens[i + 3]
            items.add((scope(), fname, number, label, ftype.rsplit(".", 1)[-1]))
            i += 5
    return items


@pytest.mark.parametrize("name", ["process", "filesystem"])
def test_proto_matches_sdk_descriptor(name: str) -> None:
    mod = pytest.importorskip(f"e2b.envd.{name}.{name}_pb")
    source = Path(mod.__file__).read_text()
    m = re.search(r"_DESC = file_desc\(\s*(b'.*?'|b\".*?\"),\n", source, re.S)
    assert m, "serialized descriptor not found in the SDK module"
    desc = ast.literal_eval(m.group(1))
    ours = _our_contract((PROTO_DIR / f"{name}.proto").read_text())
    theirs = _sdk_contract(desc)
    # Timestamp comes from google/protobuf; compare by short name on both sides.
    assert ours == theirs, {"missing": theirs - ours, "extra": ours - theirs}
