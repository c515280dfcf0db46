"""`network.rules` header transforms: E2B's shape parsed into the egress policy, placeholders
checked at create and resolved only at egress, the proxy redirect they need, and what a
sandbox's info shows (placeholders, never values)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from aenv.domain import SandboxRecord, SandboxState, record_from_json, record_to_json
from aenv.egress import EgressPolicy, UnknownSecret, placeholder_names, resolve_placeholders
from aenv.runtime.net.egress_rules import egress_rules
from tests.node_harness import Harness
from tests.unit.api_node import assert_error, assert_nothing_created

TOKEN = "${e2b.secrets.API_TOKEN}"


def _rules(host: str, **headers: str) -> dict[str, Any]:
    return {host: [{"transform": {"headers": headers}}]}


def test_policy_normalizes_rules() -> None:
    p = EgressPolicy(rules={"API.Example.com.": [{"X-A": "1"}, {}], "*.svc.test": [{}]})
    n = p.normalized()
    assert n.rules == {"api.example.com": [{"X-A": "1"}, {}], "*.svc.test": [{}]}
    assert n.intercepts and n.proxied and not n.is_open
    # Rules without a transform intercept nothing.
    bare = EgressPolicy(rules={"example.com": [{}]}).normalized()
    assert not bare.intercepts and not bare.proxied and bare.is_open


@pytest.mark.parametrize(
    ("rules", "needle"),
    [
        ({"10.0.0.1": [{"A": "b"}]}, "not a domain name"),
        ({"exa mple.com": [{"A": "b"}]}, "not a domain name"),
        ({"example.com": [{"Bad Name": "b"}]}, "not an HTTP header name"),
        ({"example.com": [{"A": "b\r\nEvil: 1"}]}, "line break"),
    ],
)
def test_policy_refuses_bad_rules(rules: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        EgressPolicy(rules=rules).normalized()


def test_headers_for_matches_hosts_and_the_exact_name_wins() -> None:
    p = EgressPolicy(
        rules={
            "*.example.com": [{"X-Scope": "wild", "X-Wild": "1"}],
            "api.example.com": [{"x-scope": "exact"}, {"X-Second": "2"}],
        }
    ).normalized()
    assert p.headers_for("api.example.com") == {"X-Wild": "1", "x-scope": "exact", "X-Second": "2"}
    assert p.headers_for("other.example.com") == {"X-Scope": "wild", "X-Wild": "1"}
    assert p.headers_for("example.com") is None  # a wildcard is not its apex
    assert p.headers_for("elsewhere.test") is None
    assert p.headers_for(None) is None


def test_placeholders_resolve_from_the_owners_secrets_only() -> None:
    store: dict[tuple[str | None, str], str] = {("alice", "api_token"): "v1", ("alice", "b"): "v2"}

    def lookup(owner: str | None, name: str) -> str | None:
        return store.get((owner, name))

    assert placeholder_names(f"Bearer {TOKEN} ${{e2b.secrets.b}}") == ["api_token", "b"]
    value = f"Bearer {TOKEN}/${{e2b.secrets.b}}"
    assert resolve_placeholders(value, "alice", lookup) == "Bearer v1/v2"
    assert resolve_placeholders("plain $HOME {x}", "alice", lookup) == "plain $HOME {x}"
    with pytest.raises(UnknownSecret) as e:
        resolve_placeholders(value, "bob", lookup)
    assert e.value.name == "api_token"
    p = EgressPolicy(rules={"h.test": [{"A": value}, {"B": "${e2b.secrets.C}"}]})
    assert p.secret_names() == {"api_token", "b", "c"}


def test_transforms_send_80_and_443_to_the_proxy() -> None:
    open_with_rules = EgressPolicy(rules={"h.test": [{"A": "b"}]})
    assert "REDIRECT --to-ports" in egress_rules(open_with_rules)
    # Open otherwise: no filter rules at all, only the redirect.
    assert "-j REJECT" not in egress_rules(open_with_rules)
    assert "REDIRECT" not in egress_rules(EgressPolicy(rules={"h.test": [{}]}))


# ------------------------------------------------------------------------------ the API


async def test_create_refuses_a_rule_naming_an_unknown_secret(
    client: httpx.AsyncClient, node: Harness
) -> None:
    network = {"rules": _rules("api.example.com", Authorization=f"Bearer {TOKEN}")}
    r = await client.post("/v2/sandboxes", json={"templateID": "base", "network": network})
    body = assert_error(r, 400)
    assert "api_token" in body["message"]
    assert_nothing_created(node)


@pytest.mark.parametrize(
    "network",
    [
        {"rules": {"api.example.com": {"transform": {}}}},  # not a list
        {"rules": {"api.example.com": [{"transform": {"headers": {"A": 1}}}]}},
        {"rules": {"10.1.2.3": [{"transform": {"headers": {"A": "b"}}}]}},
        {"rules": {"h.test": [{"transform": {"headers": {"A": "x\nB: y"}}}]}},
    ],
)
async def test_create_refuses_malformed_rules(
    client: httpx.AsyncClient, node: Harness, network: dict[str, Any]
) -> None:
    r = await client.post("/v2/sandboxes", json={"templateID": "base", "network": network})
    assert_error(r, 400)
    assert_nothing_created(node)


async def test_rules_are_kept_with_placeholders_and_shown(
    client: httpx.AsyncClient, node: Harness
) -> None:
    r = await client.post("/secrets", json={"name": "api_token", "value": "the-value-123"})
    assert r.status_code == 201
    rules = {
        "API.example.com": [
            {"transform": {"headers": {"Authorization": f"Bearer {TOKEN}"}}},
            {},
        ]
    }
    r = await client.post(
        "/v2/sandboxes",
        json={"templateID": "base", "network": {"rules": rules, "allowOut": ["api.example.com"]}},
    )
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    rec = node.orch.table.get(sid)
    assert rec.egress.rules == {"api.example.com": [{"Authorization": f"Bearer {TOKEN}"}, {}]}
    assert rec.egress.owner is None  # the fixed key's
    assert rec.instance is not None
    assert node.runtime.egress(rec.instance) == rec.egress
    info = await client.get(f"/sandboxes/{sid}")
    assert "the-value-123" not in info.text
    assert info.json()["network"]["rules"] == {
        "api.example.com": [
            {"transform": {"headers": {"Authorization": f"Bearer {TOKEN}"}}},
            {},
        ]
    }
    # The catalog holds the placeholder, not the value.
    assert b"the-value-123" not in node.settings.catalog_path.read_bytes()


async def test_update_network_checks_the_owners_secrets(
    client: httpx.AsyncClient, node: Harness
) -> None:
    r = await client.post("/v2/sandboxes", json={"templateID": "base"})
    sid = r.json()["sandboxID"]
    network = {"rules": _rules("h.test", A=TOKEN)}
    assert_error(await client.put(f"/sandboxes/{sid}/network", json=network), 400)
    assert (await client.post("/secrets", json={"name": "API_TOKEN", "value": "v"})).is_success
    r = await client.put(f"/sandboxes/{sid}/network", json=network)
    assert r.status_code == 204, r.text
    rec = node.orch.table.get(sid)
    assert rec.egress.rules == {"h.test": [{"A": TOKEN}]} and rec.egress.intercepts
    # Omitted: cleared, as every field of the update.
    assert (await client.put(f"/sandboxes/{sid}/network", json={})).status_code == 204
    assert node.orch.table.get(sid).egress.rules == {}


def test_records_keep_rules_and_stay_readable_by_older_nodes() -> None:
    now = datetime.now(UTC)
    r = SandboxRecord(
        sandbox_id="isbx",
        template_id="base",
        alias=None,
        client_id="x",
        started_at=now,
        end_at=now,
        cpu_count=1,
        memory_mb=128,
        disk_mb=1,
        state=SandboxState.RUNNING,
        envd_version="1",
        envd_access_token="t",
    )
    plain = json.loads(record_to_json(r))["egress"]
    assert "rules" not in plain and "owner" not in plain  # an older node's EgressPolicy(**d)
    r.egress = EgressPolicy(rules={"h.test": [{"A": TOKEN}]}, owner="alice")
    assert record_from_json(record_to_json(r)).egress == r.egress
