"""Settings of the image subsystem (registries, pulls, the layer cache bound).

Kept apart from `aenv.config.Settings` for now (same `AENV_` prefix, same environment), so the
two can be merged later by moving the fields; the image code only depends on the
`RegistrySettings` protocol below, which `Settings` satisfies once it carries these fields.

List-valued settings accept either a JSON list or a comma-separated string in the
environment::

    AENV_INSECURE_REGISTRIES=127.0.0.1:5000,registry.lan:5000
    AENV_SEARCH_REGISTRIES=docker.io,quay.io
    AENV_ALLOWED_REGISTRIES=docker.io,ghcr.io      # empty: every registry is allowed
    AENV_REGISTRY_CREDENTIALS='{"ghcr.io": "user:token"}'
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Protocol

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

GIB = 1 << 30


class RegistrySettings(Protocol):
    """What the registry client, the puller and the cache read from settings."""

    insecure_registries: list[str]
    search_registries: list[str]
    allowed_registries: list[str]
    registry_credentials: dict[str, str]
    docker_config: Path | None
    pull_concurrency: int
    pull_platform: str | None
    layer_cache_gb: float
    layer_cache_high: float
    layer_cache_low: float


def _split_list(value: Any) -> Any:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


class ImageSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AENV_", extra="ignore")

    # Registries reached over plain HTTP (`host:port`, as written in references). Every other
    # registry is spoken to over HTTPS with certificate verification.
    insecure_registries: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Where short names (`ubuntu`, `org/app`) are looked up, in order.
    search_registries: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["docker.io"])
    # When non-empty, only these registries may be pulled from.
    allowed_registries: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # host -> "user:password" (takes precedence over the docker config file).
    registry_credentials: dict[str, str] = Field(default_factory=dict)
    # A docker `config.json` (default: $DOCKER_CONFIG/config.json, else ~/.docker/config.json).
    docker_config: Path | None = None
    # Layers downloaded at once per pull.
    pull_concurrency: int = Field(default=3, ge=1, le=32)
    # `os/arch[/variant]` to select from multi-platform images (default: the host's).
    pull_platform: str | None = None

    # The layer cache: capacity in GiB (0 = unbounded) and watermarks as fractions of it.
    # When usage exceeds `high`, unreferenced layers are evicted (least recently used first)
    # until usage is below `low`.
    layer_cache_gb: float = Field(default=20.0, ge=0)
    layer_cache_high: float = Field(default=0.9, gt=0, le=1)
    layer_cache_low: float = Field(default=0.7, gt=0, le=1)

    @field_validator(
        "insecure_registries", "search_registries", "allowed_registries", mode="before"
    )
    @classmethod
    def _lists(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator("insecure_registries", "search_registries", "allowed_registries")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        from .reference import normalize_registry

        return [normalize_registry(v) for v in value]

    @model_validator(mode="after")
    def _watermarks(self) -> ImageSettings:
        if self.layer_cache_low > self.layer_cache_high:
            raise ValueError("layer_cache_low must not exceed layer_cache_high")
        return self

    @property
    def layer_cache_bytes(self) -> int:
        return int(self.layer_cache_gb * GIB)


def cache_capacity_bytes(settings: RegistrySettings) -> int:
    return int(settings.layer_cache_gb * GIB)
