"""Several servers as contexts (`aenv context`, `aenv auth` into one, `--context`,
`AENV_CONTEXT`), where the URL and key come from (flags > AENV_* > E2B_* > the context), and
the root's flags anywhere on the line; against the fake control plane (conftest's `fake`
and `cli`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from aenv.cli.credentials import credentials_path, load_contexts
from aenv.cli.main import app
from tests.helpers import free_port
from tests.unit.fake_aenv import API_KEY, FakeAenv, _one_error_line


@pytest.fixture
def bare(cli: CliRunner, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """The CLI with no server chosen by the environment: contexts decide."""
    monkeypatch.delenv("AENV_URL")
    monkeypatch.delenv("AENV_API_KEY")
    return cli


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_context_use_switches_the_server(bare: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a")
    dead = _dead_url()
    add = ["context", "add", "good", "--url", fake.url, "--api-key", API_KEY]
    assert bare.invoke(app, add).exit_code == 0  # the first one becomes current
    res = bare.invoke(app, ["context", "add", "dead", "--url", dead, "--api-key", "k"])
    assert res.exit_code == 0, res.output
    assert bare.invoke(app, ["ls", "-q"]).stdout == "sbx-a\n"

    assert bare.invoke(app, ["context", "use", "dead"]).exit_code == 0
    res = bare.invoke(app, ["ls"])
    assert res.exit_code == 1 and f"server at {dead}" in _one_error_line(res.stderr)

    # One call elsewhere: --context (anywhere on the line) or AENV_CONTEXT.
    assert bare.invoke(app, ["ls", "-q", "--context", "good"]).stdout == "sbx-a\n"
    assert bare.invoke(app, ["--context", "good", "ls", "-q"]).stdout == "sbx-a\n"
    res = bare.invoke(app, ["ls", "-q"], env={"AENV_CONTEXT": "good"})
    assert res.stdout == "sbx-a\n"
    res = bare.invoke(app, ["ls", "--context", "nope"])
    assert res.exit_code == 1 and "no context 'nope'" in _one_error_line(res.stderr)


def test_context_ls_show_rm(bare: CliRunner, fake: FakeAenv) -> None:
    assert (
        bare.invoke(app, ["context", "add", "a", "--url", fake.url, "--api-key", API_KEY]).exit_code
        == 0
    )
    bare.invoke(app, ["context", "add", "b", "--url", "h:1", "--api-key", "kkkkkkkkkkkkkkkkk"])
    res = bare.invoke(app, ["context", "ls", "-o", "json"])
    items = json.loads(res.stdout)
    assert [(c["name"], c["current"]) for c in items] == [("a", True), ("b", False)]
    assert items[1]["url"] == "http://h:1" and "kkkkkkkkkkkkkkkkk" not in res.stdout
    assert bare.invoke(app, ["context", "ls", "-q"]).stdout == "a\nb\n"
    table = bare.invoke(app, ["context", "ls"]).stdout.splitlines()
    assert table[1].split()[:2] == ["*", "a"]

    show = yaml.safe_load(bare.invoke(app, ["context", "show", "-o", "yaml"]).stdout)
    assert show["context"] == "a" and show["url"] == fake.url
    show = yaml.safe_load(
        bare.invoke(app, ["context", "show", "-o", "yaml", "--context", "b"]).stdout
    )
    assert show["context"] == "b" and show["selectedBy"] == "--context"

    res = bare.invoke(app, ["context", "rm", "a"])
    assert res.exit_code == 0 and res.stdout == "a\n" and "current context" in res.stderr
    assert load_contexts(credentials_path()).current is None
    assert bare.invoke(app, ["context", "use", "zzz"]).exit_code == 1


def test_auth_saves_into_a_context(bare: CliRunner, fake: FakeAenv) -> None:
    res = bare.invoke(app, ["auth", "--url", fake.url, "--api-key", API_KEY])
    assert res.exit_code == 0 and "context default" in res.stdout
    res = bare.invoke(app, ["auth", "--context", "second", "--url", fake.url, "--api-key", API_KEY])
    assert res.exit_code == 0 and "context use second" in res.stderr
    stored = load_contexts(credentials_path())
    assert list(stored.contexts) == ["default", "second"] and stored.current == "default"
    assert bare.invoke(app, ["auth", "--logout", "--context", "second"]).exit_code == 0
    assert list(load_contexts(credentials_path()).contexts) == ["default"]


def test_the_one_server_file_of_before_reads_as_context_default(
    bare: CliRunner, fake: FakeAenv
) -> None:
    fake.add("sbx-a")
    path = credentials_path()
    path.parent.mkdir(parents=True)
    path.write_text(f'url = "{fake.url}"\napi_key = "{API_KEY}"\n')
    assert bare.invoke(app, ["ls", "-q"]).stdout == "sbx-a\n"
    res = bare.invoke(app, ["context", "ls", "-q"])
    assert res.stdout == "default\n"
    # The next save writes the new shape, the old server kept.
    bare.invoke(app, ["context", "add", "other", "--url", "h:2", "--api-key", "k"])
    assert "[contexts." in path.read_text()
    assert load_contexts(path).current == "default"
    assert bare.invoke(app, ["ls", "-q"]).stdout == "sbx-a\n"


def test_e2b_variables_are_honoured_when_aenv_ones_are_unset(
    bare: CliRunner, fake: FakeAenv, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.add("sbx-a")
    monkeypatch.setenv("E2B_API_URL", fake.url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    assert bare.invoke(app, ["ls", "-q"]).stdout == "sbx-a\n"
    # AENV_* win over E2B_*.
    dead = _dead_url()
    res = bare.invoke(app, ["ls"], env={"AENV_URL": dead})
    assert res.exit_code == 1 and dead in res.stderr
    res = bare.invoke(app, ["ls"], env={"AENV_API_KEY": "wrong"})
    assert "check AENV_API_KEY" in _one_error_line(res.stderr)
    # E2B_DOMAIN: the API at https://api.<domain>, as the SDK.
    monkeypatch.delenv("E2B_API_URL")
    monkeypatch.setenv("E2B_DOMAIN", "example.invalid")
    show = yaml.safe_load(bare.invoke(app, ["context", "show", "-o", "yaml"]).stdout)
    assert show["url"] == "https://api.example.invalid" and show["urlSource"] == "E2B_DOMAIN"
    assert show["keySource"] == "E2B_API_KEY"


def test_precedence_flags_env_e2b_context(bare: CliRunner, fake: FakeAenv) -> None:
    dead = _dead_url()
    bare.invoke(app, ["context", "add", "ctx", "--url", dead, "--api-key", "ctx-key"])

    def source(*args: str, env: dict[str, str] | None = None) -> tuple[str, str]:
        res = bare.invoke(app, ["context", "show", "-o", "json", *args], env=env)
        doc = json.loads(res.stdout)
        return doc["urlSource"], doc["keySource"]

    assert source() == (f"context 'ctx' in {credentials_path()}",) * 2
    e2b = {"E2B_API_URL": fake.url, "E2B_API_KEY": "e"}
    assert source(env=e2b) == ("E2B_API_URL", "E2B_API_KEY")
    aenv = {**e2b, "AENV_URL": fake.url, "AENV_API_KEY": "a"}
    assert source(env=aenv) == ("AENV_URL", "AENV_API_KEY")
    assert source("--url", fake.url, "--api-key", "f", env=aenv) == ("--url", "--api-key")
    # --context is a flag: the context it names outranks the environment.
    assert source("--context", "ctx", env=aenv)[0].startswith("context 'ctx'")


@pytest.mark.parametrize(
    "args",
    [
        ["--url", "{url}", "--api-key", "{key}", "ls", "-q"],
        ["ls", "-q", "--url", "{url}", "--api-key", "{key}"],
        ["ls", "--url={url}", "-q", "--api-key={key}"],
        ["snapshot", "ls", "--url", "{url}", "--api-key", "{key}", "-q"],
        ["snapshot", "--url", "{url}", "ls", "--api-key", "{key}", "-q"],
    ],
)
def test_global_flags_anywhere(
    bare: CliRunner, fake: FakeAenv, args: list[str], tmp_path: Path
) -> None:
    fake.add("sbx-a")
    fake.snapshots.append({"snapshotID": "snap1", "names": []})
    argv = [a.format(url=fake.url, key=API_KEY) for a in args]
    res = bare.invoke(app, argv)
    assert res.exit_code == 0, res.output
    assert res.stdout == ("snap1\n" if "snapshot" in args else "sbx-a\n")


def test_global_flags_after_the_command_in_exec_and_debug(bare: CliRunner, fake: FakeAenv) -> None:
    fake.add("sbx-a")
    res = bare.invoke(app, ["exec", "sbx-a", "--url", fake.url, "--api-key", API_KEY, "exit 3"])
    assert res.exit_code == 3, res.output
    # After `--` they belong to the command.
    res = bare.invoke(
        app, ["exec", "--url", fake.url, "--api-key", API_KEY, "sbx-a", "--", "a", "--url"]
    )
    assert json.loads(res.stdout)["cmd"] == "a --url"
    res = bare.invoke(app, ["inspect", "nope", "--url", fake.url, "--api-key", API_KEY, "--debug"])
    assert res.exit_code == 1 and "Traceback" in res.stderr
