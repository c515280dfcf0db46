"""`/secrets` (E2B's shapes, values write-only) and the store under it: sealed at rest,
owned by an API key, names unique; and the stock SDK's `Secret` against a served node."""

from __future__ import annotations

import base64
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.config.sections import parse_secrets_key as parse_key
from aenv.errors import InternalError
from aenv.keys import KeyStore
from aenv.secretstore import SecretStore
from tests.node_harness import Harness, build
from tests.unit.api_node import API_KEY, api_client, assert_error, served

VALUE = "s3cr3t-Value-7f1c2e9a"
SECRET_FIELDS = {"secretID", "name", "currentVersion", "metadata", "createdAt", "updatedAt"}


def _no_value(r: httpx.Response) -> None:
    assert VALUE not in r.text
    assert "value" not in r.text.lower()


@pytest.fixture
async def other(node: Harness) -> AsyncIterator[httpx.AsyncClient]:
    """A client with a second, named API key."""
    key, _ = KeyStore.of(node.settings).create("bob")
    async with api_client(node, key=key) as c:
        yield c


async def test_create_list_get_update_delete(client: httpx.AsyncClient, node: Harness) -> None:
    r = await client.post(
        "/secrets", json={"name": "API_Token", "value": VALUE, "metadata": {"team": "a"}}
    )
    assert r.status_code == 201, r.text
    _no_value(r)
    made = r.json()
    assert set(made) == SECRET_FIELDS
    assert made["name"] == "api_token"  # canonical: lower case
    assert made["secretID"].startswith("sec_")
    assert made["currentVersion"] == 1 and made["metadata"] == {"team": "a"}

    for ref in (made["secretID"], "api_token", "API_TOKEN"):
        got = await client.get(f"/secrets/{ref}")
        assert got.status_code == 200, got.text
        _no_value(got)
        assert got.json() == made

    listed = await client.get("/secrets")
    assert listed.status_code == 200
    _no_value(listed)
    assert listed.json() == [made]

    r = await client.post(f"/secrets/{made['secretID']}", json={"value": "next-" + VALUE})
    assert r.status_code == 200, r.text
    assert "next-" not in r.text
    updated = r.json()
    assert updated["currentVersion"] == 2
    assert updated["metadata"] == {"team": "a"}  # kept when not given
    assert updated["createdAt"] == made["createdAt"]
    assert node.orch is not None
    r = await client.post("/secrets/api_token", json={"value": "x", "metadata": {}})
    assert r.json()["currentVersion"] == 3 and r.json()["metadata"] == {}

    assert (await client.delete("/secrets/API_TOKEN")).status_code == 204
    assert_error(await client.get(f"/secrets/{made['secretID']}"), 404)
    assert_error(await client.delete("/secrets/api_token"), 404)
    assert_error(await client.post("/secrets/api_token", json={"value": "x"}), 404)
    assert (await client.get("/secrets")).json() == []


async def test_names_are_unique_per_key_and_checked(
    client: httpx.AsyncClient, other: httpx.AsyncClient
) -> None:
    assert (await client.post("/secrets", json={"name": "tok", "value": "1"})).status_code == 201
    assert_error(await client.post("/secrets", json={"name": "TOK", "value": "2"}), 409)
    for bad in ("", "has space", "a{b}", "sec_x", "x" * 129, "dot.ted"):
        assert_error(await client.post("/secrets", json={"name": bad, "value": "v"}), 400)
    assert_error(await client.post("/secrets", json={"name": "novalue"}), 400)
    too_many = {str(i): "v" for i in range(33)}
    assert_error(
        await client.post("/secrets", json={"name": "m", "value": "v", "metadata": too_many}), 400
    )
    # Another key: its own namespace, and nothing of the first key's to see.
    assert (await other.get("/secrets")).json() == []
    assert_error(await other.get("/secrets/tok"), 404)
    assert_error(await other.delete("/secrets/tok"), 404)
    assert (await other.post("/secrets", json={"name": "tok", "value": "b"})).status_code == 201
    assert len((await client.get("/secrets")).json()) == 1


async def test_listing_pages(client: httpx.AsyncClient) -> None:
    for i in range(5):
        r = await client.post("/secrets", json={"name": f"s{i}", "value": "v"})
        assert r.status_code == 201
    names: list[str] = []
    token: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 2, **({"nextToken": token} if token else {})}
        r = await client.get("/secrets", params=params)
        names += [s["name"] for s in r.json()]
        token = r.headers.get("x-next-token")
        if token is None:
            break
    assert names == [f"s{i}" for i in range(5)]
    assert_error(await client.get("/secrets", params={"limit": 101}), 400)


async def test_values_are_sealed_at_rest(client: httpx.AsyncClient, node: Harness) -> None:
    r = await client.post("/secrets", json={"name": "tok", "value": VALUE})
    assert r.status_code == 201
    s = node.settings
    data = s.secrets_file.read_bytes()
    assert VALUE.encode() not in data
    assert base64.b64encode(VALUE.encode()) not in data
    assert s.secrets_file.stat().st_mode & 0o777 == 0o600
    assert s.secrets_key_file.stat().st_mode & 0o777 == 0o600
    # The same key opens it again (a restart); the value comes out only through lookup.
    again = SecretStore.of(s)
    assert again.lookup(None, "tok") == VALUE
    assert again.lookup(None, "other") is None
    assert again.lookup("bob", "tok") is None
    # Another key does not.
    with pytest.raises(InternalError, match="does not open"):
        SecretStore(s.secrets_file, os.urandom(32))


async def test_a_sealed_value_moved_to_another_entry_does_not_open(tmp_path: Path) -> None:
    store = SecretStore(tmp_path / "s.json", os.urandom(32))
    a = await store.create("alice", "a", "alpha", None)
    b = await store.create("alice", "b", "beta", None)
    ea, eb = store._entries[a.secret_id], store._entries[b.secret_id]
    store._entries[b.secret_id] = type(eb)(eb.info, ea.nonce, ea.sealed)
    with pytest.raises(Exception):  # noqa: B017 - the AEAD's InvalidTag
        store.lookup("alice", "b")


async def test_nodes_of_a_cluster_share_their_secrets(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two nodes' stores over one copy (a dict standing in for Redis): each change one
    makes is published sealed, the other takes it (newer versions only, deletes too) and
    resolves the value; a node whose key differs takes nothing it cannot open."""
    key = os.urandom(32)
    cluster: dict[str, str] = {}
    deleted: set[str] = set()

    async def publish(sid: str, doc: str | None) -> None:
        if doc is None:
            cluster.pop(sid, None)
            deleted.add(sid)
        else:
            cluster[sid] = doc

    a, b = SecretStore(tmp_path / "a.json", key), SecretStore(tmp_path / "b.json", key)
    for s in (a, b):
        s.publish = publish
    info = await a.create("alice", "TOKEN", VALUE, None)
    assert VALUE not in cluster[info.secret_id]  # sealed
    assert await b.sync(cluster, deleted) and b.lookup("alice", "token") == VALUE
    assert not await b.sync(cluster, deleted)  # nothing new
    await b.update("alice", "token", VALUE + "2", None)
    assert await a.sync(cluster, deleted)
    assert a.get("alice", "token").version == 2 and a.lookup("alice", "token") == VALUE + "2"
    # A node with another key: left out, said once, nothing breaks.
    c = SecretStore(tmp_path / "c.json", os.urandom(32))
    assert not await c.sync(cluster, deleted)
    assert c.listed("alice") == [] and "does not open" in caplog.text
    await a.delete("alice", "token")
    assert await b.sync(cluster, deleted) and b.listed("alice") == []
    # b's file holds what it took, sealed: a restarted node starts with it.
    await b.create("alice", "OTHER", VALUE, None)
    assert SecretStore(tmp_path / "b.json", key).lookup("alice", "other") == VALUE


def test_the_cluster_key_setting(tmp_path: Path) -> None:
    key = os.urandom(32)
    for text in (base64.b64encode(key).decode(), base64.urlsafe_b64encode(key).decode()):
        assert parse_key(text + "\n") == key
    for bad in ("not base64!", base64.b64encode(b"short").decode()):
        with pytest.raises(ValueError):
            parse_key(bad)
    h = build(tmp_path, api_key=API_KEY, secrets_key=base64.b64encode(key).decode())
    SecretStore.of(h.settings)
    assert not h.settings.secrets_key_file.exists()  # the setting's key, no file made
    h.catalog.close()


# ------------------------------------------------------------------------- the stock SDK


@pytest.fixture
def served_node(tmp_path: Path) -> Iterator[tuple[str, Harness]]:
    h = build(tmp_path, api_key=API_KEY)
    with served(h, lifespan="on") as url:
        yield url, h


def test_e2b_sdk_secrets(served_node: tuple[str, Harness]) -> None:
    from e2b import Secret

    url, _ = served_node
    opts: dict[str, Any] = {"api_key": API_KEY, "api_url": url}
    info = Secret.create("openai-key", VALUE, metadata={"env": "test"}, **opts)
    assert info.name == "openai-key" and info.version == 1
    assert Secret.get_info("openai-key", **opts).secret_id == info.secret_id
    assert Secret.update(info.secret_id, "v2", **opts).version == 2
    paginator = Secret.list(**opts)
    assert [s.name for s in paginator.next_items()] == ["openai-key"]
    assert Secret.exists("openai-key", **opts)
    assert Secret.fill("openai-key") == "${e2b.secrets.openai-key}"
    assert Secret.destroy("openai-key", **opts) is True
    assert Secret.destroy("openai-key", **opts) is False
    assert not Secret.exists("openai-key", **opts)
