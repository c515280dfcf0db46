"""Pure logic of the CLI: `ID:/path` parsing and copy planning, credential storage and
precedence, log cursors, usage errors as one line."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from aenv.cli.copy import Remote, dest_inside, parse_location, plan_upload
from aenv.cli.credentials import (
    Credentials,
    credentials_path,
    load_credentials,
    normalize_url,
    remove_credentials,
    save_credentials,
)
from aenv.cli.errors import CliError
from aenv.cli.main import app
from aenv.cli.observe import LogCursor, format_log_line
from aenv.cli.options import OutputFormat, wants_json
from aenv.cli.state import CliState

# -- cp paths -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("i1abc:/home/user/x", Remote("i1abc", "/home/user/x")),
        ("i1abc:rel/path", Remote("i1abc", "rel/path")),
        ("i1abc:", Remote("i1abc", ".")),
        ("sbx_1-a.b:/", Remote("sbx_1-a.b", "/")),
        ("i1abc:/with:colon", Remote("i1abc", "/with:colon")),
        ("./a:b", None),
        ("/abs/a:b", None),
        ("dir/a:b", None),
        ("~/x:y", None),
        ("../up:x", None),
        ("plain.txt", None),
        ("-", None),
        (":/path", None),
    ],
)
def test_parse_location(arg: str, expected: Remote | None) -> None:
    assert parse_location(arg) == expected


def test_dest_inside() -> None:
    assert dest_inside("/x/", False) and dest_inside("/x", True)
    assert not dest_inside("/x", False)


def test_plan_upload_tree_modes_and_symlinks(tmp_path: Path) -> None:
    src = tmp_path / "tree"
    (src / "a" / "b").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "a" / "b" / "f.txt").write_text("x")
    run = src / "run.sh"
    run.write_text("#!/bin/sh\n")
    run.chmod(0o755)
    (src / "plain").write_text("p")
    (src / "plain").chmod(0o644)
    (src / "link-to-file").symlink_to("plain")
    (src / "link-to-dir").symlink_to("a")
    (src / "broken").symlink_to("nowhere")
    src.chmod(0o755)
    (src / "empty").chmod(0o700)
    plan = plan_upload(src, "/dst/tree")
    assert plan.dirs == ["/dst/tree", "/dst/tree/a", "/dst/tree/empty", "/dst/tree/a/b"]
    remote = sorted(r for _, r, _ in plan.files)
    assert remote == [
        "/dst/tree/a/b/f.txt",
        "/dst/tree/link-to-file",
        "/dst/tree/plain",
        "/dst/tree/run.sh",
    ]
    assert plan.modes == {"/dst/tree/run.sh": 0o755, "/dst/tree/empty": 0o700}
    assert sorted(Path(s).name for s in plan.skipped) == ["broken", "link-to-dir"]


# -- credentials ----------------------------------------------------------------------------


def test_credentials_path_honours_xdg(tmp_path: Path) -> None:
    assert credentials_path({"XDG_CONFIG_HOME": str(tmp_path)}) == (
        tmp_path / "aenv" / "credentials"
    )
    home = Path.home() / ".config" / "aenv" / "credentials"
    assert credentials_path({}) == home
    assert credentials_path({"XDG_CONFIG_HOME": "relative/dir"}) == home


def test_save_load_remove_credentials_modes(tmp_path: Path) -> None:
    path = tmp_path / "cfg" / "aenv" / "credentials"
    save_credentials(path, Credentials("http://h:1", 'k"ey\\x'))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_credentials(path) == Credentials("http://h:1", 'k"ey\\x')
    assert [p.name for p in path.parent.iterdir()] == ["credentials"]  # no temp file left
    assert remove_credentials(path) and not remove_credentials(path)
    assert load_credentials(path) is None


def test_broken_credentials_file_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "credentials"
    path.write_text("url = 3\n")
    with pytest.raises(CliError, match="bad credentials file .*must be non-empty.*aenv auth"):
        load_credentials(path)


@pytest.mark.parametrize(
    ("raw", "url"),
    [
        ("http://h:8000/", "http://h:8000"),
        (" https://x.example.com ", "https://x.example.com"),
        ("10.0.0.5:8000", "http://10.0.0.5:8000"),
    ],
)
def test_normalize_url(raw: str, url: str) -> None:
    assert normalize_url(raw) == url


def test_normalize_url_rejects_other_schemes() -> None:
    with pytest.raises(CliError):
        normalize_url("ftp://x")
    with pytest.raises(CliError):
        normalize_url("  ")


@pytest.fixture
def stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Credentials:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    home = tmp_path / "home"
    (home / "secrets").mkdir(parents=True)
    (home / "secrets" / "api-key").write_text("local-key\n")
    monkeypatch.setenv("AENV_HOME", str(home))
    monkeypatch.setenv("AENV_LISTEN", "127.0.0.1:9999")
    for var in ("AENV_URL", "AENV_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    creds = Credentials("http://stored:8000", "stored-key")
    return creds


def test_precedence_local_defaults_without_credentials(stored: Credentials) -> None:
    st = CliState()
    assert st.url == "http://127.0.0.1:9999"
    assert st.api_key()[0] == "local-key"
    assert "local node" in st.url_source()


def test_precedence_credentials_over_local(stored: Credentials) -> None:
    save_credentials(credentials_path(), stored)
    st = CliState()
    assert st.url == "http://stored:8000" and st.api_key()[0] == "stored-key"
    assert "credentials" in st.url_source() and "credentials" in st.key_source()
    assert "aenv auth" in st.api_key()[1]  # a 401's hint names the fix


def test_precedence_options_over_credentials(stored: Credentials) -> None:
    save_credentials(credentials_path(), stored)
    st = CliState(url_option="http://other:1", api_key_option="opt-key")
    assert st.url == "http://other:1" and st.api_key()[0] == "opt-key"
    # Same URL as stored (trailing slash aside): the stored key goes with it.
    st = CliState(url_option="http://stored:8000/")
    assert st.api_key()[0] == "stored-key"
    # Another URL without a key: the stored key is never sent there.
    st = CliState(url_option="http://other:1")
    assert st.api_key()[0] == "local-key"


def test_env_overrides_credentials_through_the_cli(
    stored: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The root options read AENV_URL/AENV_API_KEY: they win over the stored file (an
    unreachable env URL is what the error names)."""
    save_credentials(credentials_path(), stored)
    monkeypatch.setenv("AENV_URL", "http://127.0.0.1:9")
    res = CliRunner().invoke(app, ["ls"])
    assert res.exit_code == 1
    assert res.stderr.startswith("aenv: cannot reach the aenv server at http://127.0.0.1:9")


def test_auth_logout_without_file(stored: Credentials) -> None:
    res = CliRunner().invoke(app, ["auth", "--logout"])
    assert res.exit_code == 0 and "no stored credentials" in res.stderr


def test_auth_unreachable_stores_nothing(stored: Credentials) -> None:
    res = CliRunner().invoke(app, ["auth", "--url", "http://127.0.0.1:9", "--api-key", "k"])
    assert res.exit_code == 1
    assert res.stderr.count("\n") == 1 and "nothing stored" in res.stderr
    assert not credentials_path().exists()


# -- output, errors, logs -------------------------------------------------------------------


def test_wants_json() -> None:
    assert wants_json(OutputFormat.json) and not wants_json(OutputFormat.table)
    assert wants_json(None)  # pytest's stdout is not a terminal


@pytest.mark.parametrize(
    "args",
    [["rm"], ["bogus"], ["ls", "--nope"], ["cp", "a"], ["--nope"], ["top", "--interval", "x"]],
)
def test_usage_errors_are_one_line(args: list[str]) -> None:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2
    assert res.stderr.startswith("aenv: ") and res.stderr.count("\n") == 1, res.stderr
    assert "--help" in res.stderr


def test_cp_needs_one_remote_side() -> None:
    res = CliRunner().invoke(app, ["cp", "a", "b"])
    assert res.exit_code == 1 and res.stderr.startswith("aenv: one side of `aenv cp`")


class _FakeCp:
    def __init__(self, pages: list[list[dict[str, Any]]]) -> None:
        self.pages = pages
        self.calls: list[dict[str, str]] = []

    def request(self, method: str, path: str, *, params: dict[str, str]) -> Any:
        self.calls.append(params)
        page = self.pages.pop(0) if self.pages else []

        class R:
            def json(self) -> dict[str, Any]:
                return {"logs": page}

        return R()


def _entry(ms: int, msg: str) -> dict[str, Any]:
    from datetime import UTC, datetime

    at = datetime.fromtimestamp(ms / 1000, UTC).isoformat()
    return {"timestamp": at, "level": "info", "message": msg, "fields": {}}


def test_log_cursor_yields_each_entry_once() -> None:
    a, b, c = _entry(1000, "a"), _entry(2000, "b"), _entry(2000, "c")
    cp = _FakeCp([[a, b], [b], [b, c], [c]])
    cur = LogCursor(cp, "sbx", {"level": "info"})  # type: ignore[arg-type]
    assert [e["message"] for e in cur.new()] == ["a", "b"]
    assert cur.new() == []
    assert [e["message"] for e in cur.new()] == ["c"]  # same millisecond as b, still new
    assert cur.new() == []
    assert cp.calls[1]["cursor"] == "2000" and cp.calls[1]["level"] == "info"


def test_log_cursor_tail_fetch_overrides_the_page_size() -> None:
    cp = _FakeCp([[_entry(3000, "c"), _entry(2000, "b")]])
    cur = LogCursor(cp, "sbx", {})  # type: ignore[arg-type]
    last = cur.fetch(direction="backward", limit="2")
    assert cp.calls[-1] == {"direction": "backward", "limit": "2"}
    cur.skip_to(list(reversed(last)))
    assert cur.cursor == 3000 and cur.new() == []


def test_format_log_line() -> None:
    e = _entry(1000, "process started")
    e["fields"] = {"pid": "7"}
    line = format_log_line(e).plain
    assert line.endswith("INFO  process started pid=7")


def test_debug_shows_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AENV_URL", "http://127.0.0.1:9")
    res = CliRunner().invoke(app, ["--debug", "ls"])
    assert res.exit_code == 1 and "Traceback" in res.stderr
    assert res.stderr.rstrip().splitlines()[-1].startswith("aenv: cannot reach")


def test_local_io_error_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    res = CliRunner().invoke(app, ["cp", str(missing), "sbx:/x"])
    assert res.exit_code == 1
    assert res.stderr == f"aenv: {os.fspath(missing)}: no such file or directory\n"
