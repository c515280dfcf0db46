"""`aenv keys` on the node host (no server), and TLS: the settings, the start-up check,
and the CLI against a control plane served over HTTPS."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from aenv.cli.main import app
from aenv.config import Settings
from aenv.errors import AenvError
from aenv.keys import KeyStore
from aenv.serving import check_tls
from tests.node_harness import build
from tests.tls import make_certs
from tests.unit.api_node import served

FIXED_KEY = "e2b_fixed_key_of_the_tls_server"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in list(os.environ):
        if var.upper().startswith("AENV_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("AENV_HOME", str(tmp_path))
    monkeypatch.setenv("AENV_CONFIG_FILE", str(tmp_path / "none.toml"))
    return tmp_path


@pytest.fixture
def cli(home: Path) -> CliRunner:
    return CliRunner()


def _error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aenv: "), stderr
    return lines[0]


def test_create_prints_the_key_once(cli: CliRunner, home: Path) -> None:
    res = cli.invoke(app, ["keys", "create", "ci"])
    assert res.exit_code == 0, res.output
    key = res.stdout.strip()
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", key)
    assert "not shown again" in res.stderr
    assert KeyStore(home / "secrets" / "api-keys.json").verify(key) is not None
    ls = cli.invoke(app, ["keys", "ls"])
    assert ls.exit_code == 0 and key not in ls.output


def test_ls_table_and_json(cli: CliRunner) -> None:
    res = cli.invoke(app, ["keys", "ls"])
    assert res.exit_code == 0 and res.stdout == "" and "no API keys" in res.stderr
    keys = {name: cli.invoke(app, ["keys", "create", name]).stdout.strip() for name in "ab"}
    table = cli.invoke(app, ["keys", "ls"]).stdout
    assert all(title in table for title in ("NAME", "KEY", "CREATED"))
    rows = [line for line in table.splitlines() if "e2b_" in line]
    assert [row.split()[1] for row in rows] == ["a", "b"]  # after the table's border
    assert keys["a"][:10] + "…" in rows[0] and keys["a"] not in table
    items = json.loads(cli.invoke(app, ["keys", "ls", "-o", "json"]).stdout)
    assert [i["name"] for i in items] == ["a", "b"]
    assert set(items[0]) == {"name", "prefix", "created", "maxSandboxes", "maxMemoryMB"}
    assert items[0]["maxSandboxes"] is None  # no limits unless given


def test_quotas_are_set_with_the_key_and_changed_later(cli: CliRunner, home: Path) -> None:
    res = cli.invoke(
        app, ["keys", "create", "rl", "--max-sandboxes", "200", "--max-memory", "4096"]
    )
    assert res.exit_code == 0, res.output
    store = KeyStore(home / "secrets" / "api-keys.json")
    quota = store.quota_of("rl")
    assert quota is not None and (quota.max_sandboxes, quota.max_memory_mb) == (200, 4096)
    assert "200 sandboxes, 4096 MiB" in cli.invoke(app, ["keys", "ls"]).stdout
    res = cli.invoke(app, ["keys", "set", "rl", "--max-sandboxes", "50"])
    assert res.exit_code == 0 and "50 sandboxes, 4096 MiB" in res.stderr
    res = cli.invoke(app, ["keys", "set", "rl", "--max-sandboxes", "0", "--max-memory", "0"])
    assert res.exit_code == 0 and "no limits" in res.stderr
    assert store.quota_of("rl") is None
    res = cli.invoke(app, ["keys", "set", "nobody", "--max-sandboxes", "1"])
    assert res.exit_code == 1 and _error_line(res.stderr) == "aenv: no API key named 'nobody'"
    res = cli.invoke(app, ["keys", "set", "rl"])
    assert res.exit_code == 1 and "nothing to set" in _error_line(res.stderr)
    res = cli.invoke(app, ["keys", "create", "bad", "--max-sandboxes", "-1"])
    assert res.exit_code != 0


def test_rm_and_its_errors(cli: CliRunner) -> None:
    cli.invoke(app, ["keys", "create", "a"])
    cli.invoke(app, ["keys", "create", "b"])
    res = cli.invoke(app, ["keys", "rm", "a"])
    assert res.exit_code == 0 and "revoked API key 'a'" in res.stderr
    res = cli.invoke(app, ["keys", "rm", "a"])
    assert res.exit_code == 1 and _error_line(res.stderr) == "aenv: no API key named 'a'"
    res = cli.invoke(app, ["keys", "rm", "b"])
    assert res.exit_code == 1 and "--force" in _error_line(res.stderr)
    assert cli.invoke(app, ["keys", "rm", "b", "--force"]).exit_code == 0
    assert json.loads(cli.invoke(app, ["keys", "ls", "-o", "json"]).stdout) == []


def test_last_key_goes_without_force_when_aenv_api_key_is_set(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    cli.invoke(app, ["keys", "create", "only"])
    monkeypatch.setenv("AENV_API_KEY", "e2b_" + "1" * 40)  # the control plane stays open
    assert cli.invoke(app, ["keys", "rm", "only"]).exit_code == 0


def test_create_errors_are_one_line(cli: CliRunner, home: Path) -> None:
    cli.invoke(app, ["keys", "create", "ci"])
    res = cli.invoke(app, ["keys", "create", "ci"])
    assert res.exit_code == 1 and "already exists" in _error_line(res.stderr)
    res = cli.invoke(app, ["keys", "create", "bad name"])
    assert res.exit_code == 1 and "invalid key name" in _error_line(res.stderr)


def test_disk_errors_are_one_line(cli: CliRunner, home: Path) -> None:
    # Stands for what a non-root user meets on a root-owned node (and works as root too).
    (home / "secrets").write_text("not a directory")
    res = cli.invoke(app, ["keys", "create", "ci"])
    assert res.exit_code == 1 and "cannot use" in _error_line(res.stderr)


def test_the_legacy_key_is_listed_as_default(cli: CliRunner, home: Path) -> None:
    (home / "secrets").mkdir(mode=0o700)
    (home / "secrets" / "api-key").write_text("e2b_" + "ab" * 20 + "\n")
    names = [i["name"] for i in json.loads(cli.invoke(app, ["keys", "ls", "-o", "json"]).stdout)]
    assert names == ["default"]
    cli.invoke(app, ["keys", "create", "ci"])
    names = [i["name"] for i in json.loads(cli.invoke(app, ["keys", "ls", "-o", "json"]).stdout)]
    assert names == ["default", "ci"]


def test_help_has_examples(cli: CliRunner) -> None:
    res = cli.invoke(app, ["keys", "--help"])
    assert res.exit_code == 0 and all(c in res.output for c in ("create", "ls", "rm"))
    for cmd in ("create", "ls", "rm"):
        res = cli.invoke(app, ["keys", cmd, "--help"])
        assert res.exit_code == 0 and "Example:" in res.output


# --------------------------------------------------------------------------------------------
# TLS


def test_tls_settings(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().url == "http://127.0.0.1:8000"
    s = Settings(tls_cert=home / "c.pem", tls_key=home / "k.pem")
    assert s.url == "https://127.0.0.1:8000" and s.scheme == "https"
    with pytest.raises(
        ValidationError, match="AENV_TLS_CERT and AENV_TLS_KEY must be set together"
    ):
        Settings(tls_cert=home / "c.pem")
    monkeypatch.setenv("AENV_TLS_KEY", str(home / "k.pem"))
    with pytest.raises(ValidationError, match="got only AENV_TLS_KEY"):
        Settings()
    monkeypatch.setenv("AENV_TLS_KEY", "")
    assert Settings().tls_key is None


def test_tls_files_are_checked_at_start(home: Path) -> None:
    a, b = make_certs(home / "a", "a"), make_certs(home / "b", "b")
    check_tls(Settings(tls_cert=a.cert, tls_key=a.key))
    with pytest.raises(AenvError, match="AENV_TLS_CERT=.*missing"):
        check_tls(Settings(tls_cert=home / "missing.pem", tls_key=a.key))
    with pytest.raises(AenvError, match="cannot use"):
        check_tls(Settings(tls_cert=a.cert, tls_key=b.key))


def test_server_refuses_half_a_tls_config(cli: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AENV_TLS_CERT", "/nonexistent/cert.pem")
    res = cli.invoke(app, ["server"])
    assert res.exit_code == 1
    assert "AENV_TLS_CERT and AENV_TLS_KEY must be set together" in _error_line(res.stderr)
    monkeypatch.setenv("AENV_TLS_KEY", "/nonexistent/key.pem")
    res = cli.invoke(app, ["server"])
    assert res.exit_code == 1
    assert "cannot use AENV_TLS_CERT=/nonexistent/cert.pem" in _error_line(res.stderr)


@pytest.fixture
def https_node(home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A node (a real orchestrator on the fake runtime) on HTTPS, and the CLI's environment
    on its host."""
    tls = make_certs(home / "tls")
    cert, key = tls.cert, tls.key
    node = build(home, api_key=FIXED_KEY, tls_cert=cert, tls_key=key)
    with served(node, ssl_certfile=str(cert), ssl_keyfile=str(key)) as url:
        port = url.rsplit(":", 1)[1]
        for name, value in {
            "AENV_LISTEN": f"127.0.0.1:{port}",
            "AENV_TLS_CERT": str(cert),
            "AENV_TLS_KEY": str(key),
            "AENV_API_KEY": FIXED_KEY,
        }.items():
            monkeypatch.setenv(name, value)
        yield f"https://127.0.0.1:{port}"


def test_cli_talks_https_and_trusts_its_node(cli: CliRunner, https_node: str) -> None:
    res = cli.invoke(app, ["ls", "-o", "json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == []


def test_cli_tls_verify_setting(
    cli: CliRunner, https_node: str, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stranger = make_certs(home / "stranger", "stranger").ca
    monkeypatch.setenv("AENV_TLS_VERIFY", str(stranger))
    res = cli.invoke(app, ["ls"])
    assert res.exit_code == 1
    assert "CERTIFICATE_VERIFY_FAILED" in _error_line(res.stderr)
    monkeypatch.setenv("AENV_TLS_VERIFY", str(home / "tls" / "aenv-test-ca.crt"))
    assert cli.invoke(app, ["ls"]).exit_code == 0
    monkeypatch.setenv("AENV_TLS_VERIFY", str(home / "nope.pem"))
    res = cli.invoke(app, ["ls"])
    assert res.exit_code == 1 and "not a usable CA file" in _error_line(res.stderr)
    # Elsewhere than on the node (its certificate unknown): `false` skips the check.
    monkeypatch.delenv("AENV_TLS_CERT")
    monkeypatch.delenv("AENV_TLS_KEY")
    monkeypatch.setenv("AENV_TLS_VERIFY", "true")
    res = cli.invoke(app, ["--url", https_node, "ls"])
    assert res.exit_code == 1 and "CERTIFICATE_VERIFY_FAILED" in _error_line(res.stderr)
    monkeypatch.setenv("AENV_TLS_VERIFY", "false")
    assert cli.invoke(app, ["--url", https_node, "ls"]).exit_code == 0


_SDK_LIST = """
import sys
from e2b import Sandbox
from e2b.exceptions import AuthenticationException
try:
    print(len(Sandbox.list().next_items()))
except AuthenticationException:
    print("401")
"""


def _sdk_list(url: str, key: str, ca: Path) -> str:
    """The stock E2B SDK, in its own process (its transports read the CA set once)."""
    env = dict(os.environ, E2B_API_URL=url, E2B_API_KEY=key, SSL_CERT_FILE=str(ca))
    env.pop("AENV_API_KEY", None)
    out = subprocess.run(
        [sys.executable, "-c", _SDK_LIST], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_stock_sdk_over_https_with_a_created_key(
    cli: CliRunner, https_node: str, home: Path
) -> None:
    key = cli.invoke(app, ["keys", "create", "sdk"]).stdout.strip()
    ca = home / "tls" / "aenv-test-ca.crt"
    assert _sdk_list(https_node, key, ca) == "0"
    assert cli.invoke(app, ["keys", "rm", "sdk", "--force"]).exit_code == 0
    assert _sdk_list(https_node, key, ca) == "401"  # the same server process
