"""Property tests for the parsers that take outside input: image references, layer tars and
Dockerfiles. Whatever the input, each either parses or raises its own error (a 400 for the
API), never another exception; a layer never writes outside its directory."""

from __future__ import annotations

import contextlib
import io
import operator
import os
import stat
import string
import tarfile
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aenv.builds.dockerfile import DockerfileError, expand, parse_dockerfile
from aenv.config import ImageSettings
from aenv.errors import BadRequest, Forbidden
from aenv.images.reference import candidates, parse_reference
from aenv.images.streams import InvalidLayer
from aenv.images.unpack import extract_tar

# --------------------------------------------------------------------------------------------
# image references

_ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"
_component = st.text(_ALNUM, min_size=1, max_size=8)
_path_component = st.builds(
    lambda a, sep, b: a + sep + b if sep is not None else a,
    _component,
    st.sampled_from([None, ".", "_", "__", "-", "--"]),
    _component,
)
_registry = st.one_of(
    st.sampled_from(["docker.io", "ghcr.io", "localhost", "localhost:5000", "127.0.0.1:5000"]),
    st.builds(lambda a, b: f"{a}.{b}", _component, st.sampled_from(["io", "com", "test"])),
)
# \A[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}\Z, composed (see test_egress_domains: no from_regex).
_TAG_HEAD = string.ascii_letters + string.digits + "_"
_tag = st.builds(operator.add, st.sampled_from(_TAG_HEAD), st.text(_TAG_HEAD + ".-", max_size=20))
_digest = st.text("0123456789abcdef", min_size=64, max_size=64).map(lambda h: "sha256:" + h)
# Characters that matter to the grammar, plus some that must never pass.
_REF_ALPHABET = _ALNUM + "ABCZ./:@_-+ \t\n\0[]%~é"


@settings(max_examples=400)
@given(st.one_of(st.text(_REF_ALPHABET, max_size=80), st.text(max_size=40)))
# Found by this test: an upper-case one-label registry was lower-cased, and printed it read as
# a Docker Hub path.
@example("A/0")
# And a newline before the tag: `$` in the grammar's patterns matched before it.
@example("0\n:0")
def test_any_text_is_a_reference_or_bad_request(text: str) -> None:
    try:
        ref = parse_reference(text)
    except BadRequest:
        return
    # What parses is canonical: printing and parsing again gives the same reference, and no
    # part of it carries whitespace, NUL or a path escape into registry URLs.
    assert parse_reference(str(ref)) == ref
    for part in (ref.registry, ref.repository, ref.tag or "", ref.digest or ""):
        assert not any(c in part for c in " \t\n\0")
    assert ".." not in ref.repository.split("/")


@settings(max_examples=200)
@given(
    st.one_of(st.none(), _registry),
    st.lists(_path_component, min_size=1, max_size=3),
    st.one_of(st.none(), _tag),
    st.one_of(st.none(), _digest),
)
def test_well_formed_references_keep_their_parts(
    registry: str | None, path: list[str], tag: str | None, digest: str | None
) -> None:
    if registry is None:
        # Without a registry, a first component with a dot would be read as one (Docker's
        # grammar): start with a plain name.
        path = [path[0].replace(".", "-"), *path[1:]]
    repository = "/".join(path)
    text = (f"{registry}/" if registry else "") + repository
    text += (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
    ref = parse_reference(text)
    assert ref.tag == tag or (tag is None and digest is None and ref.tag == "latest")
    assert ref.digest == digest
    if registry is None:
        assert ref.registry == "docker.io"
        assert ref.repository in (repository, f"library/{repository}")
    else:
        assert ref.repository.endswith(repository)
    assert parse_reference(str(ref)) == ref


@settings(max_examples=200)
@given(st.text(_REF_ALPHABET, max_size=60))
def test_candidates_raise_only_request_errors(text: str) -> None:
    conf = ImageSettings(search_registries=["docker.io", "quay.io"], allowed_registries=["quay.io"])
    try:
        refs = candidates(text, conf)
    except (BadRequest, Forbidden):
        return
    assert refs and all(r.registry == "quay.io" for r in refs)


# --------------------------------------------------------------------------------------------
# layer tars

_names = st.lists(
    st.sampled_from(
        [
            "a",
            "b",
            "dir",
            "..",
            ".",
            "",
            "/",
            "etc",
            ".wh.a",
            ".wh..wh..opq",
            ".wh.",
            "x" * 300,
            "ü",
        ]
    ),
    min_size=1,
    max_size=4,
).map("/".join)
_link_targets = st.one_of(
    _names,
    st.sampled_from(["/", "/etc", "..", "../..", "../../outside", "/../outside", "a/../../.."]),
)


@st.composite
def _members(draw: st.DrawFn) -> tarfile.TarInfo:
    info = tarfile.TarInfo(draw(_names))
    info.type = draw(
        st.sampled_from(
            [
                tarfile.REGTYPE,
                tarfile.DIRTYPE,
                tarfile.SYMTYPE,
                tarfile.LNKTYPE,
                tarfile.CHRTYPE,
                tarfile.BLKTYPE,
                tarfile.FIFOTYPE,
                b"g",
            ]
        )
    )
    if info.type in (tarfile.SYMTYPE, tarfile.LNKTYPE):
        info.linkname = draw(_link_targets)
    if info.type in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = draw(st.sampled_from([(0, 0), (1, 3), (8, 0)]))
    info.mode = draw(st.sampled_from([0o644, 0o755, 0o4755, 0o000, 0o7777]))
    info.uid = info.gid = draw(st.sampled_from([0, 1000, 65534]))
    info.mtime = 1_700_000_000
    return info


def _tar(members: list[tarfile.TarInfo]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for m in members:
            data = b"payload" if m.isreg() else None
            if data is not None:
                m.size = len(data)
            tf.addfile(m, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _snapshot(top: Path) -> dict[str, tuple[int, bytes]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st_ = p.lstat()
            body = p.read_bytes() if stat.S_ISREG(st_.st_mode) else b""
            out[str(p.relative_to(top))] = (st_.st_mode, body)
    return out


def _m(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    return info


@pytest.mark.skipif(os.geteuid() != 0, reason="unpacking needs root (chown, mknod)")
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_members(), min_size=1, max_size=8))
# The classic escapes, always tried: a symlink out of the tree and a write through it, the
# same with an absolute target, hard links to host files, and a device node.
@example([_m("a", tarfile.SYMTYPE, "../../outside"), _m("a/keep")])
@example([_m("etc", tarfile.SYMTYPE, "/etc"), _m("etc/passwd")])
@example([_m("d", tarfile.SYMTYPE, ".."), _m("d/d/outside/keep")])
@example([_m("h", tarfile.LNKTYPE, "../outside/keep")])
@example([_m("h", tarfile.LNKTYPE, "/etc/passwd")])
@example([_m("l", tarfile.SYMTYPE, "/outside"), _m("h", tarfile.LNKTYPE, "l/keep")])
@example([_m("../outside/keep")])
@example([_m("/outside/keep")])
@example([_m("sda", tarfile.BLKTYPE), _m("null", tarfile.CHRTYPE)])
# Found by this test: an empty symlink target and a 300-byte name were OSErrors (500s).
@example([_m("s", tarfile.SYMTYPE, "")])
@example([_m("x" * 300)])
def test_hostile_layers_never_write_outside_the_layer(members: list[tarfile.TarInfo]) -> None:
    blob = _tar(members)
    with tempfile.TemporaryDirectory() as tmp:
        top = Path(tmp)
        (top / "outside").mkdir()
        (top / "outside" / "keep").write_bytes(b"host file")
        (top / "etc").mkdir()
        before = _snapshot(top)
        layer = top / "layer"
        with contextlib.suppress(InvalidLayer):
            extract_tar(io.BytesIO(blob), layer)
        after = _snapshot(top)
        # Everything outside `layer` is exactly as it was.
        assert {k: v for k, v in after.items() if not k.startswith("layer")} == before
        for rel, (mode, _) in after.items():
            # Symlinks are stored as they are, never followed on the host: nothing inside
            # resolves through the host's real directories.
            path = top / rel
            if rel.startswith("layer/") and not stat.S_ISLNK(mode):
                assert os.path.realpath(path.parent).startswith(str(layer))
            # No device node but the 0/0 whiteout.
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                assert stat.S_ISCHR(mode) and path.lstat().st_rdev == 0


@settings(max_examples=300)
@given(st.binary(max_size=2048))
def test_garbage_is_an_invalid_layer(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp, contextlib.suppress(InvalidLayer):
        extract_tar(io.BytesIO(data), Path(tmp) / "layer")


# --------------------------------------------------------------------------------------------
# Dockerfiles

_KEYWORDS = [
    "FROM",
    "RUN",
    "ENV",
    "ARG",
    "WORKDIR",
    "USER",
    "COPY",
    "ADD",
    "SHELL",
    "CMD",
    "ENTRYPOINT",
    "EXPOSE",
    "LABEL",
    "VOLUME",
    "STOPSIGNAL",
    "HEALTHCHECK",
    "ONBUILD",
    "MAINTAINER",
    "from",
    "# escape=`",
    "# syntax=docker/dockerfile:1",
    "BOGUS",
]
_ARG_ALPHABET = "ab=$ {}:-+\"'[],\\`<>/.*~\t" + "AZ09_é\0"
_line = st.builds(
    lambda kw, flag, arg: " ".join(p for p in (kw, flag, arg) if p),
    st.sampled_from(_KEYWORDS),
    st.sampled_from(
        ["", "--chown=1:1", "--chmod=755", "--from=x", "--mount=type=cache", "--bad", "--chmod=zz"]
    ),
    st.text(_ARG_ALPHABET, max_size=30),
)
_dockerfile = st.one_of(
    st.lists(_line, max_size=8).map("\n".join),
    st.builds(lambda rest: "FROM alpine\n" + "\n".join(rest), st.lists(_line, max_size=8)),
    st.builds(
        lambda body, end: f"FROM alpine\nRUN <<EOF\n{body}\n{end}",
        st.text(max_size=20),
        st.sampled_from(["EOF", "", "EO"]),
    ),
    st.text(max_size=200),
)


@settings(max_examples=600)
@given(_dockerfile, st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
def test_any_text_is_a_dockerfile_or_dockerfile_error(text: str, args: dict[str, str]) -> None:
    try:
        df = parse_dockerfile(text, build_args=args)
    except DockerfileError:
        return
    assert df.from_image


@settings(max_examples=300)
@given(
    st.text(_ARG_ALPHABET, max_size=40),
    st.dictionaries(
        st.sampled_from(["a", "b", "A"]), st.text(_ARG_ALPHABET, max_size=5), max_size=3
    ),
)
def test_expand_is_text_or_dockerfile_error(text: str, env: dict[str, str]) -> None:
    try:
        out = expand(text, env)
    except DockerfileError:
        return
    assert isinstance(out, str)
    if "$" not in text and "\\" not in text:
        assert out == text
