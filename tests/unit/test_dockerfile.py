"""The Dockerfile parser (`aenv build`): instructions to E2B build steps."""

from __future__ import annotations

import pytest

from aenv.builds.dockerfile import DockerfileError, expand, parse_dockerfile


def steps(text: str, **args: str) -> list[dict[str, object]]:
    return parse_dockerfile(text, args).steps


def test_basic_instructions() -> None:
    df = parse_dockerfile(
        """
        # a comment
        FROM python:3.12-slim AS app
        ENV A=1 B="two words"
        ENV LEGACY value with spaces
        WORKDIR /srv
        WORKDIR sub
        USER nobody
        RUN echo hi \\
            && echo there
        CMD ["python", "-m", "http.server"]
        """
    )
    assert df.from_image == "python:3.12-slim"
    assert df.steps == [
        {"type": "ENV", "args": ["A", "1", "B", "two words"], "force": False},
        {"type": "ENV", "args": ["LEGACY", "value with spaces"], "force": False},
        {"type": "WORKDIR", "args": ["/srv"], "force": False},
        {"type": "WORKDIR", "args": ["/srv/sub"], "force": False},
        {"type": "USER", "args": ["nobody"], "force": False},
        {"type": "RUN", "args": ["echo hi && echo there"], "force": False},
    ]
    assert df.start_cmd() == "python -m http.server"


def test_args_defaults_build_args_and_run_exports() -> None:
    text = """
    ARG TAG=3.11
    FROM python:${TAG}
    ARG NAME=world
    ARG EMPTY
    ENV GREETING="hello $NAME" TAG_SEEN=${TAG:-none}
    RUN echo "$NAME"
    """
    df = parse_dockerfile(text)
    assert df.from_image == "python:3.11"
    assert df.steps[0]["args"] == ["GREETING", "hello world", "TAG_SEEN", "none"]
    assert df.steps[1]["args"] == ['export NAME=world; echo "$NAME"']
    df = parse_dockerfile(text, {"TAG": "3.12", "NAME": "x y", "UNUSED": "1"})
    assert df.from_image == "python:3.12"
    assert df.steps[0]["args"] == ["GREETING", "hello x y", "TAG_SEEN", "none"]
    assert df.steps[1]["args"] == ["export NAME='x y'; echo \"$NAME\""]
    assert any("UNUSED" in w for w in df.warnings)


def test_exec_form_shell_and_heredoc_run() -> None:
    s = steps(
        """
        FROM alpine
        RUN ["echo", "a b"]
        SHELL ["/bin/bash", "-eu", "-c"]
        RUN echo $HOME
        RUN <<EOF
        set -e
        echo one
        EOF
        """.replace("\n        ", "\n")
    )
    assert s[0]["args"] == ["echo 'a b'"]
    assert s[1]["args"] == ["/bin/bash -eu -c 'echo $HOME'"]
    assert s[2]["args"] == ["set -e\necho one\n"]


def test_copy_add_forms() -> None:
    df = parse_dockerfile(
        """
        FROM alpine
        WORKDIR /app
        COPY --chown=user:user --chmod=755 bin/tool ./
        COPY a.txt b.txt /dst/
        ADD ["with space.txt", "rel/dir/"]
        COPY . .
        """
    )
    copies = [(c.src, c.dest, c.owner, c.mode) for c in df.copies]
    assert copies == [
        ("bin/tool", "/app/", "user:user", "755"),
        ("a.txt", "/dst/", "root", ""),
        ("b.txt", "/dst/", "root", ""),
        ("with space.txt", "/app/rel/dir/", "root", ""),
        (".", "/app/", "root", ""),
    ]
    assert [df.steps[c.index]["type"] for c in df.copies] == ["COPY"] * 5


def test_entrypoint_and_cmd() -> None:
    df = parse_dockerfile('FROM a\nENTRYPOINT ["/entry.sh"]\nCMD ["--port", "80"]\n')
    assert df.command == ["/entry.sh", "--port", "80"]
    assert df.start_cmd() == "/entry.sh --port 80"
    df = parse_dockerfile("FROM a\nCMD ['x']\nENTRYPOINT exec server --flag\n")
    # A shell-form ENTRYPOINT ignores CMD.
    assert df.command == ["/bin/sh", "-c", "exec server --flag"]
    assert df.start_cmd() == "exec server --flag"
    assert parse_dockerfile("FROM a\n").start_cmd() is None


def test_metadata_instructions() -> None:
    df = parse_dockerfile(
        'FROM a\nEXPOSE 80 443/tcp\nLABEL a=b "c d"="e f"\nVOLUME ["/data"]\nSTOPSIGNAL SIGINT\n'
    )
    assert df.metadata == {
        "expose": ["80", "443/tcp"],
        "labels": {"a": "b", "c d": "e f"},
        "volumes": ["/data"],
        "stopsignal": "SIGINT",
    }


def test_escape_directive_and_comments_in_continuations() -> None:
    s = steps("# escape=`\nFROM a\nRUN echo a `\n# inner comment\n  && echo b\n")
    assert s == [{"type": "RUN", "args": ["echo a && echo b"], "force": False}]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("RUN x\n", "before FROM"),
        ("FROM a\nFROM b\n", "multi-stage"),
        ("FROM a\nCOPY --from=build /x /y\n", "--from"),
        ("FROM a\nADD https://example.com/x /x\n", "URL"),
        ("FROM scratch\n", "scratch"),
        ("FROM a\nCOPY ../secret /x\n", "outside"),
        ("FROM a\nCOPY a b /dir\n", "must end with /"),
        ("FROM a\nFROBNICATE\n", "unknown instruction"),
        ("# nothing\n", "no FROM"),
        ("FROM a\nONBUILD RUN x\n", "ONBUILD"),
    ],
)
def test_errors(text: str, match: str) -> None:
    with pytest.raises(DockerfileError, match=match):
        parse_dockerfile(text)


def test_expand() -> None:
    env = {"A": "1", "E": ""}
    assert expand("$A ${A} ${B:-d} ${A:+alt} ${E:-x} ${E-y} \\$A '$A'", env) == (
        "1 1 d alt x  $A '$A'"
    )
