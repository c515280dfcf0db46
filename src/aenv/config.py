"""Settings, built once (defaults < TOML file < AENV_* environment) and passed down."""

from __future__ import annotations

import secrets
import tomllib
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AENV_", extra="ignore")

    home: Path = Path("/var/lib/aenv")
    listen: str = "127.0.0.1:8000"
    api_key: str | None = None
    # Extra domains for Host-based routing: `{port}-{sandboxID}.{domain}`.
    domains: list[str] = Field(default_factory=lambda: ["localhost"])
    config_file: Path | None = None

    # Sandbox defaults (E2B's).
    default_cpu_count: int = 2
    default_memory_mb: int = 512
    default_disk_mb: int = 1024
    default_timeout: int = 300
    max_timeout: int = 24 * 3600

    # Pause: a paused sandbox is frozen at once and hibernated (checkpointed to disk, memory
    # released) after this many idle seconds; 0 hibernates at once.
    hibernate_after: float = 60.0
    # Admission: the sum of memoryMB of live sandboxes on this node may not exceed this
    # (None: 90% of the host's RAM).
    max_memory_mb: int | None = None
    # Sandboxes of the default template booted ahead of demand (envd up, not yet assigned):
    # a create that matches takes one and only has to initialise envd.
    sandbox_pool_size: int = 2
    # At start the node boots one sandbox of the default template and snapshots it once
    # envd is up: creates (and the pool) then restore that instead of booting, which skips
    # envd's start-up in gVisor (~400 ms of CPU per sandbox).
    boot_snapshots: bool = True
    # Sandboxes booted or restored at once (create, fork children, resume, pool refill):
    # each is CPU-bound in runsc and envd, so past a few per core they only slow each other
    # down (and a starved envd misses its start deadline); the rest wait their turn.
    # 0: two per CPU core.
    boot_concurrency: int = 0
    # Every snapshot/fork puts a layer on the sandbox's stack and one overlay mount takes
    # ~45 lowers: a stack longer than this is squashed in the background (its top layers
    # merged into one, same content) down to half this length; 0 turns that off (a stack
    # past the mount's limit is then squashed before it boots).
    squash_layers: int = 16

    # runtime
    runsc: str = "runsc"
    runsc_platform: str = "systrap"
    # Names of netns/veths start with this prefix; two servers on one host need two prefixes.
    net_prefix: str = "aenv"
    # Each network slot takes a /30 of this range for its host-side address.
    net_cidr: str = "10.200.0.0/16"
    net_pool_size: int = 4
    # Where `aenv template build-base` downloads Debian packages from (None: the host's mirror).
    debian_mirror: str | None = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _TomlSource(settings_cls))

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0] or "127.0.0.1"

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    @property
    def url(self) -> str:
        return f"http://{self.listen}"

    # Layout of $AENV_HOME, in one place.
    @property
    def layers_dir(self) -> Path:
        return self.home / "layers"

    @property
    def sandboxes_dir(self) -> Path:
        return self.home / "sandboxes"

    @property
    def runsc_root(self) -> Path:
        return self.home / "runsc"

    @property
    def runtime_dir(self) -> Path:
        return self.home / "runtime"

    @property
    def rw_dir(self) -> Path:
        """Per-sandbox writable layers (overlay uppers), sealed into layers by snapshots."""
        return self.home / "rw"

    @property
    def images_dir(self) -> Path:
        """Checkpoint images (memory + process state) of snapshots and hibernated sandboxes."""
        return self.home / "images"

    @property
    def catalog_path(self) -> Path:
        return self.home / "catalog.db"

    @property
    def secrets_dir(self) -> Path:
        return self.home / "secrets"

    @cached_property
    def effective_api_key(self) -> str:
        """AENV_API_KEY, else the key stored under $AENV_HOME, generated once."""
        if self.api_key:
            return self.api_key
        path = self.secrets_dir / "api-key"
        if path.exists():
            return path.read_text().strip()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = "e2b_" + secrets.token_hex(20)
        path.write_text(key + "\n")
        path.chmod(0o600)
        return key


class _TomlSource(PydanticBaseSettingsSource):
    """Reads `$AENV_CONFIG_FILE` or `$AENV_HOME/config.toml` when present."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        import os

        path = os.environ.get("AENV_CONFIG_FILE")
        if not path:
            home = os.environ.get("AENV_HOME", "/var/lib/aenv")
            path = str(Path(home) / "config.toml")
        p = Path(path)
        if not p.is_file():
            return {}
        with p.open("rb") as f:
            return tomllib.load(f)


def load_settings(**overrides: Any) -> Settings:
    return Settings(**overrides)
