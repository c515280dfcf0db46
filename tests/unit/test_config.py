"""Settings: defaults < config.toml < AENV_* environment, image and snapshot sections included."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError
from pydantic_settings import SettingsError

from aenv.config import _SECTIONS, Settings


@pytest.fixture
def toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The config file Settings reads; starts absent, with no AENV_* variable set."""
    for var in list(os.environ):
        if var.upper().startswith("AENV_"):
            monkeypatch.delenv(var)
    path = tmp_path / "config.toml"
    monkeypatch.setenv("AENV_CONFIG_FILE", str(path))
    return path


def test_defaults(toml: Path, tmp_path: Path) -> None:
    s = Settings(home=tmp_path)
    assert s.default_timeout == 300
    assert s.images.layer_cache_gb == 20.0 and s.images.search_registries == ["docker.io"]
    assert s.snapshots.snapshot_repo is None and int(s.snapshots.snapshot_cache_size) == 20 << 30


def test_toml_sets_top_level_image_and_snapshot_settings(toml: Path, tmp_path: Path) -> None:
    toml.write_text(
        "default_timeout = 77\n"
        "layer_cache_gb = 3.5\n"
        'insecure_registries = ["127.0.0.1:5000"]\n'
        'snapshot_repo = "s3://bucket/prefix"\n'
        'snapshot_cache_size = "1GiB"\n'
    )
    s = Settings(home=tmp_path)
    assert s.default_timeout == 77
    assert s.images.layer_cache_gb == 3.5
    assert s.images.insecure_registries == ["127.0.0.1:5000"]
    assert s.snapshots.snapshot_repo == "s3://bucket/prefix"
    assert int(s.snapshots.snapshot_cache_size) == 1 << 30


def test_toml_tables_and_aenv_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AENV_CONFIG_FILE the file is $AENV_HOME/config.toml; a section's table wins
    over a flat key of the same name."""
    monkeypatch.delenv("AENV_CONFIG_FILE", raising=False)
    monkeypatch.setenv("AENV_HOME", str(tmp_path))
    (tmp_path / "config.toml").write_text(
        "pull_concurrency = 2\n"
        "[images]\n"
        "pull_concurrency = 5\n"
        'pull_platform = "linux/arm64"\n'
        "[snapshots]\n"
        's3_endpoint = "http://127.0.0.1:9000"\n'
    )
    s = Settings()
    assert s.home == tmp_path
    assert s.images.pull_concurrency == 5 and s.images.pull_platform == "linux/arm64"
    assert s.snapshots.s3_endpoint == "http://127.0.0.1:9000"


def test_environment_overrides_toml(
    toml: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml.write_text(
        "default_timeout = 77\nlayer_cache_gb = 3\n[snapshots]\ns3_region = 'eu-west-1'\n"
    )
    monkeypatch.setenv("AENV_DEFAULT_TIMEOUT", "90")
    monkeypatch.setenv("AENV_LAYER_CACHE_GB", "4")
    monkeypatch.setenv("AENV_S3_REGION", "us-east-2")
    monkeypatch.setenv("AENV_SNAPSHOT_CACHE_SIZE", "512MiB")
    s = Settings(home=tmp_path)
    assert s.default_timeout == 90
    assert s.images.layer_cache_gb == 4.0
    assert s.snapshots.s3_region == "us-east-2"
    assert int(s.snapshots.snapshot_cache_size) == 512 << 20


def test_comma_lists_and_json_values(
    toml: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml.write_text('allowed_registries = "ghcr.io, quay.io"\n')
    monkeypatch.setenv("AENV_INSECURE_REGISTRIES", "127.0.0.1:5000, registry.lan:5000")
    monkeypatch.setenv("AENV_SEARCH_REGISTRIES", '["quay.io", "index.docker.io"]')
    monkeypatch.setenv("AENV_REGISTRY_CREDENTIALS", '{"ghcr.io": "user:token"}')
    s = Settings(home=tmp_path).images
    assert s.insecure_registries == ["127.0.0.1:5000", "registry.lan:5000"]
    assert s.search_registries == ["quay.io", "docker.io"]
    assert s.allowed_registries == ["ghcr.io", "quay.io"]
    assert s.registry_credentials == {"ghcr.io": "user:token"}


@pytest.mark.parametrize(
    ("var", "value", "field"),
    [
        ("AENV_LAYER_CACHE_GB", "lots", "images.layer_cache_gb"),
        ("AENV_PULL_CONCURRENCY", "0", "images.pull_concurrency"),
        ("AENV_SNAPSHOT_CACHE_SIZE", "big", "snapshots.snapshot_cache_size"),
        ("AENV_SNAPSHOT_COMPRESSION", "lz4", "snapshots.snapshot_compression"),
        ("AENV_DEFAULT_TIMEOUT", "soon", "default_timeout"),
    ],
)
def test_bad_environment_values_name_the_setting(
    toml: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    var: str,
    value: str,
    field: str,
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValidationError) as ei:
        Settings(home=tmp_path)
    assert field in str(ei.value) and value in str(ei.value)


def test_bad_toml_is_a_clear_error(toml: Path, tmp_path: Path) -> None:
    toml.write_text("layer_cache_high = 0.5\nlayer_cache_low = 0.8\n")
    with pytest.raises(ValidationError, match="layer_cache_low must not exceed"):
        Settings(home=tmp_path)
    toml.write_text("images = 3\n")
    with pytest.raises(SettingsError, match="must be a table"):
        Settings(home=tmp_path)
    toml.write_text("default_timeout = \n")
    with pytest.raises(SettingsError, match="not valid TOML"):
        Settings(home=tmp_path)


def test_bad_json_in_environment(
    toml: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AENV_REGISTRY_CREDENTIALS", "{not json")
    with pytest.raises(SettingsError, match="registry_credentials"):
        Settings(home=tmp_path)


def test_section_fields_do_not_shadow_top_level_ones() -> None:
    """Flat names are one namespace: a section field named like a top-level one would be
    ambiguous in the environment and at the top of the TOML file."""
    top = set(Settings.model_fields)
    seen: set[str] = set()
    for section in _SECTIONS.values():
        names = set(section.model_fields)
        assert not names & top and not names & seen
        seen |= names


def test_domain_from_environment_or_toml(
    toml: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Settings(home=tmp_path).domain is None
    assert Settings(home=tmp_path).routing_domains == ["localhost"]
    toml.write_text('domain = "Sandboxes.Example.COM."\n')
    s = Settings(home=tmp_path)
    assert s.domain == "sandboxes.example.com"
    assert s.routing_domains == ["sandboxes.example.com", "localhost"]
    # A :port is kept for the clients' URLs, left out of routing.
    monkeypatch.setenv("AENV_DOMAIN", "aenv.localhost:8443")
    s = Settings(home=tmp_path)
    assert s.domain == "aenv.localhost:8443"
    assert s.routing_domains == ["aenv.localhost", "localhost"]
    monkeypatch.setenv("AENV_DOMAIN", "")
    assert Settings(home=tmp_path).domain is None


@pytest.mark.parametrize(
    "bad", ["https://x.example.com", "a..b", "-a.example.com", "x.example.com:0", "x:99999", "a b"]
)
def test_bad_domain_is_refused(toml: Path, tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValidationError, match="domain"):
        Settings(home=tmp_path, domain=bad)
