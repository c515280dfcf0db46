"""Every create body (v1 and v2 `POST /sandboxes`, `POST /sandboxes-cold`) becomes the
orchestrator's `CreateRequest` through one conversion: each field a client sets reaches the
request, and each request field a client may set has a body field."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from aenv.api.models import NewSandbox, NewSandboxV2, SandboxOptions
from aenv.api.routes.images import ColdSandbox
from aenv.domain import CreateRequest, EgressPolicy, MountRequest
from aenv.errors import BadRequest

# A value other than the default for every option a create body carries.
EVERY_OPTION: dict[str, Any] = {
    "timeout": 77,
    "autoPause": True,
    "autoResume": {"enabled": True},
    "standbyAfter": 9,
    "allow_internet_access": False,
    "network": {
        "allowOut": ["203.0.113.7"],
        "denyOut": ["0.0.0.0/0"],
        "dnsServers": ["203.0.113.53"],
        "allowPublicTraffic": False,
        "maskRequestHost": "app-${PORT}.example.test",
        "rules": {"API.example.test": [{"transform": {"headers": {"X-Key": "${e2b.secrets.k}"}}}]},
    },
    "metadata": {"team": "rl"},
    "envVars": {"STEP": "1"},
    "cpuCount": 3,
    "memoryMB": 768,
    "volumeMounts": [{"name": "data", "path": "/data", "readOnly": True}],
}

EXPECTED = CreateRequest(
    timeout=77,
    metadata={"team": "rl"},
    env_vars={"STEP": "1"},
    cpu_count=3,
    memory_mb=768,
    auto_pause=True,
    auto_resume=True,
    egress=EgressPolicy(
        allow_internet=False,
        allow_out=["203.0.113.7"],
        deny_out=["0.0.0.0/0"],
        dns_servers=["203.0.113.53"],
        rules={"api.example.test": [{"X-Key": "${e2b.secrets.k}"}]},
        owner="team-key",  # whose secrets the placeholders name
    ).normalized(),
    public_traffic=False,
    mask_request_host="app-${PORT}.example.test",
    volume_mounts=[MountRequest("data", "/data", True)],
    owner="team-key",
    standby_after=9,
)

# What a body names besides the options: where the sandbox comes from.
SOURCES: list[tuple[type[SandboxOptions], dict[str, Any], str]] = [
    (NewSandbox, {"templateID": "tpl-1", "secure": True}, "tpl-1"),
    (NewSandboxV2, {"templateID": "tpl-1"}, "tpl-1"),
    (ColdSandbox, {"image": "registry.test/app:1"}, CreateRequest().template_id),
]


def request_of(body: SandboxOptions) -> CreateRequest:
    if isinstance(body, NewSandboxV2):
        return body.to_request("team-key", body.template_id)
    return body.to_request("team-key")


@pytest.mark.parametrize(("model", "source", "template"), SOURCES)
def test_every_option_of_each_body_reaches_the_request(
    model: type[SandboxOptions], source: dict[str, Any], template: str
) -> None:
    body = model.model_validate({**source, **EVERY_OPTION})
    assert request_of(body) == dataclasses.replace(EXPECTED, template_id=template)


@pytest.mark.parametrize(("model", "source", "template"), SOURCES)
@pytest.mark.parametrize("option", sorted(EVERY_OPTION))
def test_each_option_alone_changes_the_request(
    model: type[SandboxOptions], source: dict[str, Any], template: str, option: str
) -> None:
    plain = request_of(model.model_validate(source))
    one = request_of(model.model_validate({**source, option: EVERY_OPTION[option]}))
    assert one != plain, f"{model.__name__}.{option} does not reach the request"


def test_every_request_field_a_client_may_set_has_a_body_option() -> None:
    # All but template_id (named by each body its own way) differ from the defaults above,
    # so a field added to CreateRequest fails here until a body sets it.
    # auto_pause_memory too: E2B refuses its non-default with autoResume (tested below).
    default = CreateRequest()
    unset = [
        f.name
        for f in dataclasses.fields(CreateRequest)
        if f.name != "template_id" and getattr(EXPECTED, f.name) == getattr(default, f.name)
    ]
    assert unset == ["auto_pause_memory"]


@pytest.mark.parametrize(("model", "source", "template"), SOURCES)
def test_a_filesystem_only_auto_pause_and_its_refusals(
    model: type[SandboxOptions], source: dict[str, Any], template: str
) -> None:
    """SDK `lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}}` reaches the
    request; E2B refuses it without autoPause and with autoResume (traffic cannot wake a
    filesystem-only pause: it must be resumed explicitly)."""
    fs_only = {**source, "autoPause": True, "autoPauseMemory": False}
    req = request_of(model.model_validate(fs_only))
    assert req.auto_pause and not req.auto_pause_memory and not req.auto_resume
    with pytest.raises(BadRequest, match="only applies when autoPause is true"):
        request_of(model.model_validate({**source, "autoPauseMemory": False}))
    with pytest.raises(BadRequest, match="cannot be combined with autoResume"):
        request_of(model.model_validate({**fs_only, "autoResume": {"enabled": True}}))
    # autoResume without an auto-pause is E2B's too: it wakes a sandbox paused by its user.
    assert request_of(model.model_validate({**source, "autoResume": {"enabled": True}})).auto_resume


def test_the_options_are_the_same_fields_in_every_body() -> None:
    options = set(SandboxOptions.model_fields)
    for model, _, _ in SOURCES:
        assert options <= set(model.model_fields)
