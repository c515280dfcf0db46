"""Settings, built once (defaults < TOML file < AENV_* environment) and passed down.

`Settings` holds the node-wide knobs and two sections, `images` (`ImageSettings`) and
`snapshots` (`SnapshotSettings`), which the image and snapshot code take on their own. A
section's fields are set by the same flat names as the others: ``AENV_LAYER_CACHE_GB`` in the
environment, ``layer_cache_gb = 5`` at the top of the TOML file, or the same key in the
section's table (``[images]`` / ``[snapshots]``), which wins over a flat one.

List-valued image settings accept a TOML/JSON list or a comma-separated string::

    AENV_INSECURE_REGISTRIES=127.0.0.1:5000,registry.lan:5000
    AENV_SEARCH_REGISTRIES=docker.io,quay.io
    AENV_ALLOWED_REGISTRIES=docker.io,ghcr.io      # empty: every registry is allowed
    AENV_REGISTRY_CREDENTIALS='{"ghcr.io": "user:token"}'
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import tomllib
from functools import cache, cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from ..nodenet import node_network
from .sections import (
    DEFAULT_IMAGE_ALIASES,
    GIB,
    ImageSettings,
    SnapshotSettings,
    parse_secrets_key,
)

__all__ = [
    "DEFAULT_IMAGE_ALIASES",
    "GIB",
    "ImageSettings",
    "Settings",
    "SnapshotSettings",
    "load_settings",
]

_DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")

# The sections of `Settings`, by field name. Their fields share the flat AENV_ namespace.
_SECTIONS: dict[str, type[BaseModel]] = {"images": ImageSettings, "snapshots": SnapshotSettings}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AENV_", extra="ignore")

    home: Path = Path("/var/lib/aenv")
    listen: str = "127.0.0.1:8000"
    # A key that always authenticates, besides the named keys of `aenv keys`.
    api_key: str | None = None
    # Both set: the listener serves HTTPS with this certificate (PEM, may hold the chain)
    # and private key.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # For the CLI: `true` (system CAs, plus this node's AENV_TLS_CERT when readable, so a
    # self-signed node needs no set-up on its own host), `false`, or a CA bundle's path.
    tls_verify: str = "true"
    # The node's public domain, as E2B_DOMAIN names it to the SDKs: the API answers at
    # `api.{domain}`, sandboxes at `{port}-{sandboxID}.{domain}` (a wildcard DNS name and
    # certificate pointing at this listener), and creates return it as `domain`. A `:port`
    # suffix is the port clients reach the listener on when it is not 443 (kept in the
    # URLs the SDKs build, ignored when routing).
    domain: str | None = None
    # Extra domains for Host-based routing: `{port}-{sandboxID}.{domain}`.
    domains: list[str] = Field(default_factory=lambda: ["localhost"])
    config_file: Path | None = None

    # Sandbox defaults (E2B's).
    default_cpu_count: int = 2
    default_memory_mb: int = 512
    # The writable layer's size per sandbox (sparse: a limit, not a reservation).
    default_disk_mb: int = 10240
    # That size enforced (btrfs quota or ext4 image); `disk_spares`: ext4 images kept formatted.
    disk_limits: bool = True
    disk_spares: int = 2
    # Where layers and uppers live, chosen at a home's first start (`runtime/storage/cowpool.py`).
    storage: Literal["auto", "btrfs", "ext4"] = "auto"
    # The runtime backend (`runtime/select.py`): gVisor, QEMU microVMs, or the in-memory fake
    # (tests: no sandbox ever boots, as nothing answers inside).
    runtime: Literal["gvisor", "qemu", "fake"] = "gvisor"
    default_timeout: int = 300
    max_timeout: int = 24 * 3600
    # Build `code-interpreter-v1` in the background at start when it is missing or out of
    # date, so the stock e2b-code-interpreter SDK works on a fresh node (builds/autobuild.py).
    code_interpreter_autobuild: bool = True

    # Pause: a paused sandbox is frozen at once and hibernated (checkpointed to disk, memory
    # released) after this many idle seconds; 0 hibernates at once.
    hibernate_after: float = 60.0
    # Naps (`runtime/naps.py`): a running sandbox with no request for this many seconds and
    # next to no CPU use of its own sleeps in long stretches until the next request; 0: never.
    nap_after: float = 10.0
    # Standby: a napping sandbox with no CPU use of its own and no request for this many
    # seconds is frozen until its next request (still `running` to its user); 0: never.
    # Per sandbox: `standbyAfter` at create; per template: `standbyAfter` on PATCH.
    standby_after: float = 0.0
    # Standby on disk: a sandbox in standby this many seconds more is hibernated (memory
    # released), still `running` to its user; its next request restores it. 0: never (it
    # still goes to disk early when a create or resume needs its memory).
    standby_disk_after: float = 600.0
    # Admission: the sum of memoryMB of live sandboxes on this node may not exceed this
    # (None: 90% of the host's RAM).
    max_memory_mb: int | None = None
    # The budget above times this: sandboxes rarely use all their memoryMB, so a node may
    # promise more than it has (idle ones in standby go to disk when the promise is called).
    memory_overcommit: float = Field(default=1.0, ge=1.0)
    # Admission: at most this many sandboxes holding memory (running or frozen, the warm
    # pool's included) on the node; 0: the memory budget alone decides. Past it: 429.
    max_sandboxes: int = 0
    # Admission: creates are refused (503) while the node's disk under $AENV_HOME has less
    # free than this (sandbox disks are sparse: their sizes are limits, not reservations).
    min_free_disk_mb: int = 1024
    # The server's log lines: `text` (`... sandbox_id=ID` at the end of a line about a
    # sandbox) or `json` (one object a line, `sandbox_id` a key).
    log_format: Literal["text", "json"] = "text"
    # One log line per API request (method, path, status, milliseconds, request id): off
    # by default, since a busy node answers thousands a second. Every answer carries its
    # `X-Request-Id` either way.
    access_log: bool = False
    # `host:port` of a second, plain-HTTP listener that serves only `GET /metrics`, without
    # the API key (as Prometheus exporters do; who may reach it is the network's to decide,
    # e.g. `0.0.0.0:9464` with a NetworkPolicy letting only Prometheus in). Unset: none;
    # `/metrics` on the main port (with the key) is there either way.
    metrics_listen: str | None = None
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
    # Creates that may wait for a boot slot; past them a create is refused at once (503 with
    # `Retry-After`) instead of waiting behind boots the CPU cannot keep up with. 0: as many
    # as would wait up to 30 s at the boots' recent pace.
    boot_queue: int = 0
    # Every snapshot/fork puts a layer on the sandbox's stack and one overlay mount takes
    # ~45 lowers: a stack longer than this is squashed in the background (its top layers
    # merged into one, same content) down to half this length; 0 turns that off (a stack
    # past the mount's limit is then squashed before it boots).
    squash_layers: int = 16

    # Lifecycle events (docs/events.md): kept this many days (E2B keeps 7), then forgotten.
    events_retention_days: float = Field(default=7.0, gt=0)
    # Events waiting for one webhook at most (a receiver down for long): past it the
    # oldest are dropped, counted (`aenv_webhook_deliveries_total{outcome="dropped"}`).
    webhook_backlog: int = Field(default=10000, ge=1)
    # A delivery's timeout, and its retries' backoff: doubling from `webhook_backoff`
    # seconds up to `webhook_backoff_max`, for as long as the event is kept.
    webhook_timeout: float = Field(default=10.0, gt=0)
    webhook_backoff: float = Field(default=1.0, gt=0)
    webhook_backoff_max: float = Field(default=300.0, gt=0)

    # runtime
    runsc: str = "runsc"
    runsc_platform: str = "systrap"
    # Names of netns/veths start with this prefix; two servers on one host need two prefixes.
    net_prefix: str = "aenv"
    # Each network slot takes a /30 of this range for its host-side address.
    net_cidr: str = "10.200.0.0/16"
    net_pool_size: int = 4
    # The QEMU backend (`runtime/qemu/`): the guest kernel and its modules
    # (scripts/install-guest-kernel.sh), and the accelerator: "auto" probes KVM once per host
    # boot and falls back to TCG emulation.
    qemu: str = "qemu-system-x86_64"
    qemu_guest_dir: Path = Path("/usr/local/lib/aenv/guest")
    qemu_accel: Literal["auto", "kvm", "tcg"] = "auto"
    # Where volumes live (`/volumes`): one directory per volume, its metadata beside its
    # files, nothing about them elsewhere, so it may be a file system nodes share (NFS...).
    # None: $AENV_HOME/volumes.
    volumes_root: Path | None = None
    # Secrets (docs/secrets.md): the key that seals `/secrets` values at rest, base64 of 32
    # bytes; one for every node of a cluster. None: the node's own `secrets/secrets.key`,
    # made at the first start.
    secrets_key: SecretStr | None = None
    # A PEM bundle of CAs the egress proxy trusts besides the system's when it re-encrypts
    # an intercepted HTTPS request (a host with header `rules`) to the real host.
    egress_ca_bundle: Path | None = None
    # Where `aenv template build-base` downloads Debian packages from (None: the host's mirror).
    debian_mirror: str | None = None

    # cluster (docs/cluster.md): a node joins when `redis_url` is set; a gateway needs it.
    redis_url: str | None = None
    # This node's name in the cluster (default: the host name). Set explicitly, it also
    # picks the node's own `net_prefix` and `net_cidr` unless those are set, so several
    # nodes share one host without setting them.
    node_id: str | None = None
    # Where gateways reach this node (default: http://<host address>:<port>).
    advertise_url: str | None = None
    heartbeat_seconds: float = 2.0
    # A node that stops (SIGTERM: a pod's deletion, `docker stop`) first moves every sandbox
    # into the shared repository, so each resumes on another node at its next request
    # instead of dying with the container. Only with a repository (`snapshot_repo`).
    drain_on_stop: bool = True
    # At a stop, how long requests in flight may go on (after that drain) before they are
    # cut: a command's output stream or a PTY need never end on its own.
    stop_grace_seconds: int = 10
    # A gateway marks a node unhealthy this long after its last heartbeat.
    node_dead_after: float = 6.0
    # Where a gateway learns node addresses: their Redis registrations, or also the
    # EndpointSlices of a headless Service (`kubernetes`).
    discovery: Literal["redis", "kubernetes"] = "redis"
    kubernetes_service: str = "aenv-node"
    kubernetes_namespace: str | None = None
    # The gateway's placement of creates: `least-loaded` or `module:attribute` (a class
    # implementing `aenv.cluster.scheduler.Scheduler`).
    scheduler: str = "least-loaded"

    images: ImageSettings = Field(default_factory=ImageSettings)
    snapshots: SnapshotSettings = Field(default_factory=SnapshotSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, _EnvSource(settings_cls), _TomlSource(settings_cls))

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0] or "127.0.0.1"

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.listen}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"

    @property
    def routing_domains(self) -> list[str]:
        """The domains whose `{port}-{id}.` names route to sandboxes, `domain` first."""
        own = [self.domain.rsplit(":", 1)[0]] if self.domain else []
        return own + [d for d in self.domains if d not in own]

    @field_validator("domain", mode="before")
    @classmethod
    def _domain(cls, value: Any) -> Any:
        if value is None or not isinstance(value, str):
            return value
        text = value.strip().strip(".").lower()
        if not text:
            return None  # `AENV_DOMAIN=` (empty) means unset
        name, sep, port = text.partition(":")
        name = name.rstrip(".")
        labels = name.split(".")
        if (
            "://" in text
            or len(name) > 253
            or not all(_DNS_LABEL.fullmatch(label) for label in labels)
            or (sep and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536))
        ):
            raise ValueError(f"domain must be a DNS name with an optional :port, got {value!r}")
        return f"{name}:{int(port)}" if sep else name

    @field_validator("metrics_listen", mode="before")
    @classmethod
    def _metrics_listen(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        text = value.strip()
        if not text:
            return None  # `AENV_METRICS_LISTEN=` (empty) means off
        host, sep, port = text.rpartition(":")
        if not sep or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"metrics_listen must be host:port, got {value!r}")
        return text

    @field_validator("tls_cert", "tls_key", "volumes_root", mode="before")
    @classmethod
    def _unset_if_empty(cls, value: Any) -> Any:
        # `AENV_TLS_CERT=` (empty) means unset, not the current directory.
        return None if value == "" else value

    @model_validator(mode="after")
    def _node_network(self) -> Settings:
        if self.node_id is not None:
            derived = node_network(self.node_id)
            if "net_prefix" not in self.model_fields_set:
                self.net_prefix = derived[0]
            if "net_cidr" not in self.model_fields_set:
                self.net_cidr = derived[1]
        return self

    @property
    def cluster_node_id(self) -> str:
        return self.node_id or socket.gethostname().split(".")[0] or "aenv"

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError(
                "AENV_TLS_CERT and AENV_TLS_KEY must be set together (got only "
                + ("AENV_TLS_CERT" if self.tls_cert else "AENV_TLS_KEY")
                + ")"
            )
        return self

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
    def disks_dir(self) -> Path:
        return self.home / "disks"

    @property
    def rw_dir(self) -> Path:
        """Per-sandbox writable layers (overlay uppers), sealed into layers by snapshots."""
        return self.home / "rw"

    @property
    def images_dir(self) -> Path:
        """Checkpoint images (memory + process state) of snapshots and hibernated sandboxes."""
        return self.home / "images"

    @property
    def cache_dir(self) -> Path:
        """The node's caches of fetched artifacts (memory images) and their staging area."""
        return self.home / "cache"

    @property
    def repo_dir(self) -> Path:
        """The local snapshot repository, unless `snapshots.snapshot_repo` names another."""
        return self.home / "repo"

    @property
    def volumes_dir(self) -> Path:
        return self.volumes_root or self.home / "volumes"

    @property
    def catalog_path(self) -> Path:
        return self.home / "catalog.db"

    @property
    def events_path(self) -> Path:
        return self.home / "events.db"

    @property
    def secrets_dir(self) -> Path:
        return self.home / "secrets"

    @property
    def api_keys_file(self) -> Path:
        """The named API keys, hashed (`aenv keys`, `aenv.keys`)."""
        return self.secrets_dir / "api-keys.json"

    def cluster_secrets_key(self) -> bytes | None:
        """AENV_SECRETS_KEY decoded: the cluster's key (secrets, the egress CA), if given."""
        return (
            None
            if self.secrets_key is None
            else parse_secrets_key(self.secrets_key.get_secret_value())
        )

    @property
    def secrets_key_file(self) -> Path:
        """The key sealing `/secrets` values, unless AENV_SECRETS_KEY gives one."""
        return self.secrets_dir / "secrets.key"

    @property
    def secrets_file(self) -> Path:
        """`/secrets`, their values sealed (`aenv.secretstore`)."""
        return self.secrets_dir / "secrets.json"

    @property
    def egress_ca_dir(self) -> Path:
        """The egress proxy's CA (key 0600 and certificate) and the host certificates it
        signs for intercepted HTTPS."""
        return self.secrets_dir / "egress-ca"

    @property
    def api_key_file(self) -> Path:
        """The `default` key in plain text, for the CLI on the node host."""
        return self.secrets_dir / "api-key"

    @cached_property
    def upload_secret(self) -> str:
        """Signs the build-file upload URLs; its own secret, so that no API key's
        revocation (or AENV_API_KEY's change) bears on uploads, generated once."""
        path = self.secrets_dir / "upload-key"
        if path.exists():
            return path.read_text().strip()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        secret = secrets.token_hex(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
        return secret


class _EnvSource(EnvSettingsSource):
    """``AENV_<FIELD>`` for the top-level fields, and the same flat names for the fields of
    each section (``AENV_LAYER_CACHE_GB`` sets ``images.layer_cache_gb``)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        if field_name in _SECTIONS:
            return None, field_name, False
        return super().get_field_value(field, field_name)

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        for name, section in _SECTIONS.items():
            values = EnvSettingsSource(_env_reader(section))()
            if values:
                data[name] = values
        return data


@cache
def _env_reader(section: type[BaseModel]) -> type[BaseSettings]:
    """`section` as a BaseSettings class, so that pydantic-settings decodes its variables
    exactly as it does the top-level ones (JSON for dicts, `NoDecode` lists left raw)."""
    config = SettingsConfigDict(env_prefix="AENV_", extra="ignore")
    return type(f"_{section.__name__}Env", (BaseSettings, section), {"model_config": config})


class _TomlSource(PydanticBaseSettingsSource):
    """Reads `$AENV_CONFIG_FILE` or `$AENV_HOME/config.toml` when present. A section's keys
    may stand at the top (flat, like the environment) or in its own table."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("AENV_CONFIG_FILE")
        if not path:
            home = os.environ.get("AENV_HOME", "/var/lib/aenv")
            path = str(Path(home) / "config.toml")
        p = Path(path)
        if not p.is_file():
            return {}
        try:
            with p.open("rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise SettingsError(f"{p}: not valid TOML: {e}") from None
        for name, section in _SECTIONS.items():
            flat = {k: data.pop(k) for k in list(data) if k in section.model_fields}
            table = data.get(name, {})
            if not isinstance(table, dict):
                raise SettingsError(f"{p}: {name!r} must be a table ([{name}])")
            if flat or table:
                data[name] = {**flat, **table}
        return data


def load_settings(**overrides: Any) -> Settings:
    return Settings(**overrides)
