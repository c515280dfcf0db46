"""The node's API keys: the store on disk (hashed, private, atomic, locked, reloaded on
change) and its use by the control plane's auth."""

from __future__ import annotations

import json
import multiprocessing
import re
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import aenv.keys
from aenv.config import Settings
from aenv.errors import BadRequest, Conflict, NotFound
from aenv.keys import KeyStore
from tests.node_harness import Harness, build, started
from tests.unit.api_node import api_client, assert_error, served

FIXED_KEY = "e2b_fixed_key_from_the_environment"


@pytest.fixture
def store(tmp_path: Path) -> KeyStore:
    return KeyStore(tmp_path / "secrets" / "api-keys.json", tmp_path / "secrets" / "api-key")


def test_create_verify_list(store: KeyStore) -> None:
    key, entry = store.create("ci")
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", key)
    assert entry.name == "ci" and key.startswith(entry.prefix) and len(entry.prefix) < len(key)
    assert store.verify(key) == entry
    assert store.verify(key[:-1] + ("0" if key[-1] != "0" else "1")) is None
    assert store.verify("") is None
    assert [k.listing() for k in store.entries()] == [entry.listing()]
    assert set(entry.listing()) == {"name", "prefix", "created", "maxSandboxes", "maxMemoryMB"}


def test_file_holds_hashes_only_and_is_private(store: KeyStore) -> None:
    keys = [store.create(f"k{i}")[0] for i in range(3)]
    text = store.path.read_text()
    for key in keys:
        assert key not in text and key[len("e2b_") :] not in text
    data = json.loads(text)
    assert [k["name"] for k in data["keys"]] == ["k0", "k1", "k2"]
    assert len({k["salt"] for k in data["keys"]}) == 3  # a salt per key
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.path.parent.stat().st_mode) == 0o700
    leftovers = [p.name for p in store.path.parent.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_names_are_unique_and_checked(store: KeyStore) -> None:
    store.create("ci")
    with pytest.raises(Conflict, match="already exists"):
        store.create("ci")
    for bad in ("", "has space", "-dash", "x" * 65, "a/b"):
        with pytest.raises(BadRequest):
            store.create(bad)
    assert [k.name for k in store.entries()] == ["ci"]


def test_revoke_and_the_last_key(store: KeyStore) -> None:
    a, _ = store.create("a")
    b, _ = store.create("b")
    store.remove("a")
    assert store.verify(a) is None and store.verify(b) is not None
    with pytest.raises(NotFound):
        store.remove("a")
    with pytest.raises(Conflict, match="last API key.*--force"):
        store.remove("b")
    assert store.verify(b) is not None
    store.remove("b", allow_last=True)
    assert store.verify(b) is None and store.entries() == ()


def test_a_running_reader_sees_changes_without_a_restart(
    store: KeyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = KeyStore(store.path)  # the server's instance; `store` plays the CLI
    assert server.verify("e2b_x") is None
    key, _ = store.create("ci")
    assert server.verify(key) is not None
    other, _ = store.create("other")
    store.remove("ci")
    assert server.verify(key) is None and server.verify(other) is not None

    reads = 0
    real_read = KeyStore._read

    def counting_read(self: KeyStore) -> Any:
        nonlocal reads
        reads += self is server
        return real_read(self)

    monkeypatch.setattr(KeyStore, "_read", counting_read)
    for _ in range(50):
        assert server.verify(other) is not None
    assert reads == 0  # unchanged file: no read per request
    store.create("third")
    assert server.verify(other) is not None and reads == 1


def test_every_hash_is_compared_in_constant_time(
    store: KeyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, _ = store.create("first")
    for i in range(4):
        store.create(f"k{i}")
    calls: list[tuple[bytes, bytes]] = []
    real = aenv.keys.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(aenv.keys.hmac, "compare_digest", spy)
    assert store.verify(first) is not None  # matches the first key, still checks all five
    assert len(calls) == 5
    calls.clear()
    assert store.verify("e2b_" + "0" * 40) is None
    assert len(calls) == 5


def _create_many(path: str, worker: int, count: int) -> None:
    store = KeyStore(Path(path))
    for i in range(count):
        store.create(f"w{worker}-{i}")


def test_concurrent_creates_lose_no_key(store: KeyStore) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_create_many, args=(str(store.path), w, 8)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    names = {k.name for k in store.entries()}
    assert names == {f"w{w}-{i}" for w in range(4) for i in range(8)}


def test_bootstrap_generates_default_once(store: KeyStore) -> None:
    assert store.legacy_file is not None
    key = store.bootstrap(generate=True)
    assert key is not None and store.legacy_file.read_text().strip() == key
    assert stat.S_IMODE(store.legacy_file.stat().st_mode) == 0o600
    assert store.verify(key) is not None and store.entries()[0].name == "default"
    assert store.bootstrap(generate=True) is None
    assert [k.name for k in store.entries()] == ["default"]


def test_bootstrap_without_generate_writes_nothing(store: KeyStore) -> None:
    assert store.bootstrap(generate=False) is None
    assert not store.path.exists()


def test_legacy_key_becomes_default(store: KeyStore) -> None:
    assert store.legacy_file is not None
    store.legacy_file.parent.mkdir(mode=0o700)
    store.legacy_file.write_text("e2b_legacy_key\n")
    assert [k.name for k in store.listed()] == ["default"]  # shown before the first write
    key, _ = store.create("ci")  # the first write takes the legacy key in
    assert store.verify("e2b_legacy_key") is not None and store.verify(key) is not None
    assert store.bootstrap(generate=True) is None


def test_revoking_default_deletes_its_plain_copy_for_good(store: KeyStore) -> None:
    assert store.legacy_file is not None
    default = store.bootstrap(generate=True)
    assert default is not None
    store.create("ci")
    store.remove("default")
    assert not store.legacy_file.exists() and store.verify(default) is None
    assert store.bootstrap(generate=True) is None  # a node never re-opens itself
    assert [k.name for k in store.entries()] == ["ci"]


def test_a_broken_file_authenticates_nobody(store: KeyStore) -> None:
    key, _ = store.create("ci")
    store.path.write_text("{not json")
    assert store.verify(key) is None


# --------------------------------------------------------------------------------------------
# the control plane's auth


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Harness]:
    """A node (a real orchestrator on the fake runtime) without AENV_API_KEY."""
    async for h in started(tmp_path, api_key=None):
        yield h


@pytest.fixture
def settings(node: Harness) -> Settings:
    return node.settings


@pytest.fixture
async def client(node: Harness) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(node, key=None) as c:
        yield c


async def test_both_headers_carry_a_stored_key(
    settings: Settings, client: httpx.AsyncClient
) -> None:
    key, _ = KeyStore.of(settings).create("ci")
    for headers in (
        {"X-API-Key": key},
        {"Authorization": f"Bearer {key}"},
        {"authorization": f"bearer  {key} "},
    ):
        r = await client.get("/sandboxes", headers=headers)
        assert r.status_code == 200, (headers, r.text)


async def test_wrong_and_revoked_keys_get_e2b_401(
    settings: Settings, client: httpx.AsyncClient
) -> None:
    cli_store = KeyStore.of(settings)
    key, _ = cli_store.create("ci")
    other, _ = cli_store.create("other")
    assert (await client.get("/sandboxes", headers={"X-API-Key": key})).status_code == 200
    for headers in ({"X-API-Key": "e2b_" + "0" * 40}, {"Authorization": "Bearer nope"}, {}):
        assert_error(await client.get("/v2/sandboxes", headers=headers), 401)
    cli_store.remove("ci")  # the app is not restarted
    for headers in ({"X-API-Key": key}, {"Authorization": f"Bearer {key}"}):
        body = assert_error(await client.get("/sandboxes", headers=headers), 401)
        assert body["message"] == "Invalid API key"
    assert (await client.get("/sandboxes", headers={"X-API-Key": other})).status_code == 200


async def test_the_environment_key_always_works(tmp_path: Path) -> None:
    async for h in started(tmp_path, api_key=FIXED_KEY):
        store = KeyStore.of(h.settings)
        key, _ = store.create("ci")
        store.remove("ci", allow_last=True)
        async with api_client(h, key=None) as c:
            for headers in ({"X-API-Key": FIXED_KEY}, {"Authorization": f"Bearer {FIXED_KEY}"}):
                assert (await c.get("/sandboxes", headers=headers)).status_code == 200
            assert_error(await c.get("/sandboxes", headers={"X-API-Key": key}), 401)


def test_server_start_generates_the_default_key(tmp_path: Path) -> None:
    h = build(tmp_path, api_key=None)
    settings = h.settings
    with served(h) as url:  # runs the lifespan, as `aenv server` does
        key = settings.api_key_file.read_text().strip()
        assert re.fullmatch(r"e2b_[0-9a-f]{40}", key)
        r = httpx.get(f"{url}/sandboxes", headers={"X-API-Key": key})
        assert r.status_code == 200
    assert [k.name for k in KeyStore.of(settings).entries()] == ["default"]


def test_no_key_is_generated_beside_the_environment_key(tmp_path: Path) -> None:
    h = build(tmp_path, api_key=FIXED_KEY)
    settings = h.settings
    with served(h):
        pass
    assert not settings.api_key_file.exists() and not settings.api_keys_file.exists()
