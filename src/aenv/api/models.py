"""Pydantic models matching E2B's control-plane JSON exactly (camelCase on the wire).

Request models ignore unknown fields (the SDKs send more than we use: network, mcp, iam, ...).
Response models drop `None` fields when serialised, except the ones E2B always sends
(`_KEEP_NULL`), so `model_dump(by_alias=True)` is the wire shape wherever it is called.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    Field,
    field_validator,
)

from aenv.domain import (
    DEFAULT_TEMPLATE,
    CreateRequest,
    EgressPolicy,
    MountRequest,
    SandboxRecord,
)
from aenv.domain import SandboxState as State
from aenv.errors import BadRequest
from aenv.secretstore import SecretStore

from .inputs import EnvVars, Metadata
from .tree_models import LineageInfo
from .wire import ApiRequest, ApiResponse, ApiState

# How our lifecycle states look through E2B's two-state lens; the same mapping as
# `SandboxTable.list(states=...)` applies. States missing here (killing, killed, lost) are
# invisible: listed nowhere, 404 on get.
_API_STATE: dict[State, ApiState] = {
    State.CREATING: "running",
    State.RUNNING: "running",
    State.RESUMING: "running",
    State.PAUSING: "running",
    State.PAUSED: "paused",
}


def api_state(r: SandboxRecord) -> ApiState | None:
    """The E2B state of a record, or None when the sandbox is gone as far as clients know.
    A sandbox the node put on disk from standby is still running to its user."""
    return "running" if r.in_standby_on_disk else _API_STATE.get(r.state)


# --------------------------------------------------------------------------------------------
# Requests


class AutoResume(ApiRequest):
    enabled: bool = False


class NetworkTransform(ApiRequest):
    """E2B's SandboxNetworkTransform: headers set on matching requests (values may hold
    `${e2b.secrets.NAME}`, resolved at egress only)."""

    headers: dict[str, str] | None = Field(default=None, max_length=64)


class NetworkRule(ApiRequest):
    """E2B's SandboxNetworkRule."""

    transform: NetworkTransform | None = None


class EgressRules(ApiRequest):
    """The egress part of E2B's SandboxNetworkConfig / SandboxNetworkUpdateConfig."""

    allow_out: list[str] | None = Field(default=None, alias="allowOut", max_length=1000)
    deny_out: list[str] | None = Field(default=None, alias="denyOut", max_length=1000)
    dns_servers: list[str] | None = Field(default=None, alias="dnsServers", max_length=16)
    # Not supported yet: refused when set rather than silently dropped.
    egress_proxy: dict[str, Any] | None = Field(default=None, alias="egressProxy")
    # Per-host header transforms: host (a domain, `*.domain`) → its rules.
    rules: dict[str, list[NetworkRule]] | None = Field(default=None, max_length=100)

    def policy(self, allow_internet_access: bool | None, owner: str | None = None) -> EgressPolicy:
        """The validated policy (BadRequest naming the first bad entry); `owner`: whose
        secrets its placeholders name."""
        if self.egress_proxy:
            raise BadRequest("network.egressProxy is not supported by this server")
        rules = {
            host: [dict(r.transform.headers or {}) if r.transform else {} for r in host_rules]
            for host, host_rules in (self.rules or {}).items()
        }
        try:
            return EgressPolicy(
                allow_internet=allow_internet_access is not False,
                allow_out=list(self.allow_out or []),
                deny_out=list(self.deny_out or []),
                dns_servers=None if self.dns_servers is None else list(self.dns_servers),
                rules=rules,
                owner=owner,
            ).normalized()
        except ValueError as e:
            raise BadRequest(f"invalid network rule: {e}") from None


async def check_secrets(policy: EgressPolicy, secrets: SecretStore) -> None:
    """BadRequest when a placeholder of the rules names a secret its owner does not have
    (E2B's 400): a typo is told at create, not as a failed request later. In a cluster the
    nodes' latest are read first, when one is missing here."""
    names = policy.secret_names()
    if names and secrets.missing(policy.owner, names):
        await secrets.refreshed()
    missing = secrets.missing(policy.owner, names)
    if missing:
        listed = ", ".join(repr(n) for n in missing)
        raise BadRequest(f"network.rules: no secret named {listed} (see /secrets)")


class NetworkConfig(EgressRules):
    """`network` of a create request."""

    # False: the sandbox's own ports answer only requests with its traffic access token.
    allow_public_traffic: bool | None = Field(default=None, alias="allowPublicTraffic")
    # The Host header its ports see; `${PORT}` is replaced by the port.
    mask_request_host: str | None = Field(default=None, alias="maskRequestHost", max_length=255)


class NetworkUpdate(EgressRules):
    """Body of `PUT /sandboxes/{id}/network`: replaces the rules; omitted fields are cleared."""

    # snake_case on the wire, as E2B has it.
    allow_internet_access: bool | None = None


class VolumeMountBody(ApiRequest):
    """An item of a create's `volumeMounts`."""

    name: str = Field(min_length=1, max_length=255)
    path: str = Field(min_length=1, max_length=1024)
    # aenv's extension: E2B mounts volumes read-write only.
    read_only: bool = Field(default=False, alias="readOnly")


class SandboxOptions(ApiRequest):
    """What every create body sets besides where the sandbox comes from (a template, an
    image), turned into the orchestrator's request in one place (`to_request`)."""

    timeout: int | None = Field(default=None, ge=0)
    auto_pause: bool | None = Field(default=None, alias="autoPause")
    auto_pause_memory: bool | None = Field(default=None, alias="autoPauseMemory")
    auto_resume: AutoResume | None = Field(default=None, alias="autoResume")
    # aenv's own: seconds idle before standby (frozen until the next request, still
    # running to its user); 0 never; absent: the node's AENV_STANDBY_AFTER.
    standby_after: int | None = Field(default=None, alias="standbyAfter", ge=0, le=86400)
    # snake_case on the wire, as E2B has it.
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None
    metadata: Metadata | None = None
    env_vars: EnvVars | None = Field(default=None, alias="envVars")
    # Our extensions for a cold boot's size.
    cpu_count: int | None = Field(default=None, alias="cpuCount", ge=1, le=16)
    memory_mb: int | None = Field(default=None, alias="memoryMB", ge=128, le=65536)
    volume_mounts: list[VolumeMountBody] | None = Field(
        default=None, alias="volumeMounts", max_length=16
    )

    def check_lifecycle(self) -> None:
        """E2B's rules for the on-timeout action (SDK `lifecycle`): a filesystem-only
        auto-pause (`autoPauseMemory: false`) needs `autoPause`, and cannot be woken by
        traffic (a cold boot must be asked for), so not with `autoResume`."""
        if self.auto_pause_memory is False and not self.auto_pause:
            raise BadRequest("autoPauseMemory=false only applies when autoPause is true.")
        if self.auto_pause_memory is False and self.auto_resume and self.auto_resume.enabled:
            raise BadRequest(
                "autoPauseMemory=false (filesystem-only auto-pause) cannot be combined with "
                "autoResume: a filesystem-only snapshot cannot be auto-resumed by traffic and "
                "must be resumed explicitly."
            )

    def to_request(self, owner: str | None, template_id: str = DEFAULT_TEMPLATE) -> CreateRequest:
        """The orchestrator's request (`owner`: the API key's name, whose quota applies)."""
        self.check_lifecycle()
        network = self.network or NetworkConfig()
        return CreateRequest(
            template_id=template_id,
            timeout=self.timeout,
            metadata=dict(self.metadata or {}),
            env_vars=dict(self.env_vars or {}),
            cpu_count=self.cpu_count,
            memory_mb=self.memory_mb,
            auto_pause=bool(self.auto_pause),
            auto_pause_memory=self.auto_pause_memory is not False,
            auto_resume=bool(self.auto_resume and self.auto_resume.enabled),
            egress=network.policy(self.allow_internet_access, owner),
            public_traffic=network.allow_public_traffic is not False,
            mask_request_host=network.mask_request_host or None,
            volume_mounts=[
                MountRequest(v.name, v.path, v.read_only) for v in self.volume_mounts or []
            ],
            owner=owner,
            standby_after=self.standby_after,
        )


class NewSandboxV2(SandboxOptions):
    """Body of `POST /v2/sandboxes`."""

    template_id: str = Field(alias="templateID", min_length=1, max_length=255)


class NewSandbox(NewSandboxV2):
    """Body of v1 `POST /sandboxes`: v2 plus `secure`, accepted for AgentENV's clients but
    ignored (every sandbox gets an envd access token)."""

    secure: bool | None = None


class ConnectSandbox(ApiRequest):
    """Body of v1 `POST /sandboxes/{id}/connect`: `timeout` is required."""

    timeout: int = Field(ge=0)
    memory: bool | None = None


class ConnectSandboxV2(ApiRequest):
    """Body of `POST /v2/sandboxes/{id}/connect`."""

    timeout: int | None = Field(default=None, ge=0)
    memory: bool | None = None


class ResumedSandbox(ApiRequest):
    """Body of the legacy `POST /sandboxes/{id}/resume`."""

    timeout: int | None = Field(default=None, ge=0)
    auto_pause: bool | None = Field(default=None, alias="autoPause")
    memory: bool | None = None


class TimeoutBody(ApiRequest):
    """Body of `POST /sandboxes/{id}/timeout`: seconds from now."""

    timeout: int = Field(ge=0)


class RefreshBody(ApiRequest):
    """Body of `POST /sandboxes/{id}/refreshes`."""

    duration: int | None = Field(default=None, ge=0, le=3600)


class PauseBody(ApiRequest):
    """Body of `POST /sandboxes/{id}/pause`."""

    memory: bool | None = None
    require_healthy_guest: bool | None = Field(default=None, alias="requireHealthyGuest")


# --------------------------------------------------------------------------------------------
# Responses


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


class Sandbox(ApiResponse):
    """Create/connect/resume response."""

    _KEEP_NULL: ClassVar[frozenset[str]] = frozenset({"trafficAccessToken", "domain"})

    sandbox_id: str = Field(alias="sandboxID")
    template_id: str = Field(alias="templateID")
    client_id: str = Field(alias="clientID")
    envd_version: str = Field(alias="envdVersion")
    alias: str | None = None
    envd_access_token: str | None = Field(default=None, alias="envdAccessToken")
    traffic_access_token: str | None = Field(default=None, alias="trafficAccessToken")
    domain: str | None = None

    @classmethod
    def from_record(cls, record: SandboxRecord, domain: str | None = None) -> Sandbox:
        """`domain`: the node's AENV_DOMAIN, from which the SDKs build the sandbox's hosts."""
        return cls(
            sandboxID=record.sandbox_id,
            templateID=record.template_id,
            clientID=record.client_id,
            envdVersion=record.envd_version,
            alias=record.alias,
            envdAccessToken=record.envd_access_token or None,
            trafficAccessToken=record.traffic_access_token or None,
            domain=domain,
        )


class VolumeMountInfo(ApiResponse):
    name: str
    path: str
    # Only when true (aenv's extension).
    read_only: bool | None = Field(default=None, alias="readOnly")


class _SandboxInfo(ApiResponse):
    """Fields shared by `ListedSandbox` and `SandboxDetail`."""

    template_id: str = Field(alias="templateID")
    sandbox_id: str = Field(alias="sandboxID")
    client_id: str = Field(alias="clientID")
    alias: str | None = None
    started_at: datetime = Field(alias="startedAt")
    end_at: datetime = Field(alias="endAt")
    cpu_count: int = Field(alias="cpuCount")
    memory_mb: int = Field(alias="memoryMB")
    disk_size_mb: int = Field(alias="diskSizeMB")
    state: ApiState
    envd_version: str = Field(alias="envdVersion")
    metadata: dict[str, str] = Field(default_factory=dict)
    volume_mounts: list[VolumeMountInfo] | None = Field(default=None, alias="volumeMounts")

    @field_validator("started_at", "end_at")
    @classmethod
    def _tz(cls, value: datetime) -> datetime:
        return _aware(value)

    @classmethod
    def _common(cls, record: SandboxRecord, state: ApiState) -> dict[str, Any]:
        return {
            "templateID": record.template_id,
            "sandboxID": record.sandbox_id,
            "clientID": record.client_id,
            "alias": record.alias,
            "startedAt": record.started_at,
            "endAt": record.end_at,
            "cpuCount": record.cpu_count,
            "memoryMB": record.memory_mb,
            "diskSizeMB": record.disk_mb,
            "state": state,
            "envdVersion": record.envd_version,
            "metadata": dict(record.metadata),
            "volumeMounts": [
                VolumeMountInfo(name=m.name, path=m.path, readOnly=m.read_only or None)
                for m in record.volume_mounts
            ]
            or None,
        }


class ListedSandbox(_SandboxInfo):
    """An item of `GET /sandboxes` and `GET /v2/sandboxes`."""

    @classmethod
    def from_record(cls, record: SandboxRecord, state: ApiState) -> ListedSandbox:
        return cls(**cls._common(record, state))


class BulkFailure(ApiResponse):
    """A sandbox a bulk operation could not act on, and why."""

    sandbox_id: str = Field(alias="sandboxID")
    code: int
    message: str


class BulkResult(ApiResponse):
    """Answer of the bulk routes (routes/bulk.py): the ids acted on, the ids that failed."""

    sandbox_ids: list[str] = Field(alias="sandboxIDs")
    failed: list[BulkFailure] = Field(default_factory=list)


class Lifecycle(ApiResponse):
    auto_resume: bool = Field(alias="autoResume")
    on_timeout: Literal["pause", "kill"] = Field(alias="onTimeout")


class NetworkInfo(ApiResponse):
    """The egress rules of a sandbox, as `GET /sandboxes/{id}` shows them."""

    allow_public_traffic: bool = Field(alias="allowPublicTraffic")
    allow_out: list[str] = Field(alias="allowOut")
    deny_out: list[str] = Field(alias="denyOut")
    # Left out when not set (E2B: missing means the default, 8.8.8.8).
    dns_servers: list[str] | None = Field(default=None, alias="dnsServers")
    mask_request_host: str | None = Field(default=None, alias="maskRequestHost")
    # As given (placeholders, never a secret's value); left out when there are none.
    rules: dict[str, list[dict[str, Any]]] | None = None

    @classmethod
    def of(cls, r: SandboxRecord) -> NetworkInfo:
        rules = {
            host: [{"transform": {"headers": dict(h)}} if h else {} for h in host_rules]
            for host, host_rules in r.egress.rules.items()
        }
        return cls(
            allowPublicTraffic=not r.traffic_access_token,
            allowOut=list(r.egress.allow_out),
            denyOut=list(r.egress.deny_out),
            dnsServers=None if r.egress.dns_servers is None else list(r.egress.dns_servers),
            maskRequestHost=r.mask_request_host,
            rules=rules or None,
        )


class SandboxDetail(_SandboxInfo):
    """`GET /sandboxes/{id}`."""

    _KEEP_NULL: ClassVar[frozenset[str]] = frozenset({"domain"})

    envd_access_token: str | None = Field(default=None, alias="envdAccessToken")
    allow_internet_access: bool | None = Field(default=None, alias="allowInternetAccess")
    network: NetworkInfo | None = None
    domain: str | None = None
    lifecycle: Lifecycle
    lineage: LineageInfo

    @classmethod
    def from_record(
        cls, record: SandboxRecord, state: ApiState, domain: str | None = None
    ) -> SandboxDetail:
        return cls(
            **cls._common(record, state),
            envdAccessToken=record.envd_access_token or None,
            allowInternetAccess=record.egress.allow_internet,
            network=NetworkInfo.of(record),
            domain=domain,
            lifecycle=Lifecycle(
                autoResume=record.auto_resume,
                onTimeout="pause" if record.auto_pause else "kill",
            ),
            lineage=LineageInfo.of(record.lineage),
        )


class ErrorBody(BaseModel):
    """E2B's error JSON (for the OpenAPI document; errors are produced by `aenv.errors`)."""

    code: int
    message: str
    error_code: str | None = None


# What a route that boots, restores or reaches a sandbox may answer besides its success:
# admission (429 past the sandbox count, 503 past the memory or disk budget), envd not
# answering (502) or too slow (504), on top of the usual client errors.
LIFECYCLE_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody} for status in (400, 401, 404, 409, 429, 500, 502, 503, 504)
}
