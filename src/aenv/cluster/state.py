"""The cluster's state in Redis: node registrations (rewritten by every heartbeat), each
node's roster of sandboxes, the sandbox→node bindings and the template→node bindings of
builds in flight.

    {ns}:nodes            hash  node id -> NodeRecord JSON
    {ns}:roster:{node}    hash  sandbox id -> RosterEntry JSON (replaced by each heartbeat)
    {ns}:bindings         hash  sandbox id -> node id
    {ns}:templates        hash  template id -> node id (where its builds run)

Bindings are written when a gateway places a create and by each node from its roster: a
node writes the bindings of the sandboxes that joined its roster since its last heartbeat,
and all of them when its registration was missing (its first heartbeat, or Redis restarted
empty), so a restarted Redis holds every binding again within one heartbeat."""

from __future__ import annotations

from collections.abc import Mapping

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..redact import url_without_password
from .records import NodeRecord, RosterEntry

# Deletes a binding only while it still names this node (another node may have taken the
# sandbox over since).
_UNBIND_IF = """
for i, sid in ipairs(ARGV) do
  if i > 1 and redis.call('HGET', KEYS[1], sid) == ARGV[1] then
    redis.call('HDEL', KEYS[1], sid)
  end
end
return 0
"""


# Stamps a node's heartbeat with Redis's own clock (a script may read TIME since Redis 5:
# its effects, not the script, are replicated).
_SEEN_NOW = """
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], ARGV[1], t[1] .. '.' .. string.format('%06d', tonumber(t[2])))
return 0
"""
# Fields of a registration only the reader fills in.
_READER_FIELDS = {"healthy", "seen_at", "seen_ago"}


def _text(v: bytes | str | None) -> str | None:
    # decode_responses=True: always str at run time; the client's types say bytes too.
    return v.decode() if isinstance(v, bytes) else v


class ClusterState:
    def __init__(self, url: str, namespace: str = "aenv") -> None:
        # Where it is, for logs: never the password (the connection keeps the URL itself).
        self.url = url_without_password(url)
        self.ns = namespace
        # A restarted Redis leaves every pooled connection dead: retried on a new one.
        self.redis = aioredis.from_url(
            url,
            decode_responses=True,
            socket_timeout=5,
            socket_connect_timeout=3,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
        )
        self._seen_now = self.redis.register_script(_SEEN_NOW)

    async def close(self) -> None:
        await self.redis.aclose()

    def _k(self, *parts: str) -> str:
        return ":".join((self.ns, *parts))

    # ------------------------------------------------------------------ nodes
    async def heartbeat(
        self,
        node: NodeRecord,
        roster: Mapping[str, RosterEntry],
        previous: set[str] | None,
    ) -> set[str]:
        """Writes the node's registration and roster and brings its bindings up to date
        (`previous`: the roster of its last heartbeat, None to write every binding).
        Returns the roster's ids, for the next call."""
        nid = node.node_id
        known = await self.redis.hexists(self._k("nodes"), nid)
        ids = set(roster)
        fresh = ids if previous is None or not known else ids - previous
        gone = set() if previous is None else previous - ids
        doc = node.model_dump_json(exclude=_READER_FIELDS)
        async with self.redis.pipeline(transaction=True) as p:
            p.hset(self._k("nodes"), nid, doc)
            await self._seen_now(keys=[self._k("seen")], args=[nid], client=p)
            p.delete(self._k("roster", nid))
            if roster:
                p.hset(
                    self._k("roster", nid),
                    mapping={sid: e.model_dump_json() for sid, e in roster.items()},
                )
            if fresh:
                p.hset(self._k("bindings"), mapping=dict.fromkeys(fresh, nid))
            await p.execute()
        if gone:
            await self.unbind_if(nid, gone)
        return ids

    async def nodes(self, dead_after: float) -> list[NodeRecord]:
        """Every registered node, `healthy` when Redis took its last heartbeat at most
        `dead_after` seconds ago (by Redis's clock: the node's and ours may be off)."""
        async with self.redis.pipeline(transaction=False) as p:
            p.hgetall(self._k("nodes"))
            p.hgetall(self._k("seen"))
            p.time()
            raw, seen, (secs, micros) = await p.execute()
        now = secs + micros / 1e6
        out = []
        for nid, doc in raw.items():
            n = NodeRecord.model_validate_json(doc)
            n.seen_at = float(seen.get(nid, 0.0))
            n.seen_ago = max(0.0, now - n.seen_at)
            n.healthy = n.seen_ago <= dead_after
            out.append(n)
        out.sort(key=lambda n: n.node_id)
        return out

    async def set_status(self, node_id: str, status: str) -> None:
        """Changes a registration's status at once (its next heartbeat says it too)."""
        doc = await self.redis.hget(self._k("nodes"), node_id)
        if doc is None:
            return
        n = NodeRecord.model_validate_json(doc)
        n.status = "draining" if status == "draining" else "ready"
        await self.redis.hset(self._k("nodes"), node_id, n.model_dump_json(exclude=_READER_FIELDS))

    async def forget_node(self, node_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as p:
            p.hdel(self._k("nodes"), node_id)
            p.hdel(self._k("seen"), node_id)
            p.delete(self._k("roster", node_id))
            await p.execute()

    async def roster(self, node_id: str) -> dict[str, RosterEntry]:
        raw = await self.redis.hgetall(self._k("roster", node_id))
        return {str(_text(sid)): RosterEntry.model_validate_json(v) for sid, v in raw.items()}

    async def roster_entry(self, node_id: str, sandbox_id: str) -> RosterEntry | None:
        doc = await self.redis.hget(self._k("roster", node_id), sandbox_id)
        return None if doc is None else RosterEntry.model_validate_json(doc)

    # ------------------------------------------------------------------ bindings
    async def binding(self, sandbox_id: str) -> str | None:
        return _text(await self.redis.hget(self._k("bindings"), sandbox_id))

    async def bind(self, sandbox_id: str, node_id: str) -> None:
        await self.redis.hset(self._k("bindings"), sandbox_id, node_id)

    async def unbind(self, sandbox_id: str) -> None:
        await self.redis.hdel(self._k("bindings"), sandbox_id)

    async def unbind_if(self, node_id: str, sandbox_ids: set[str]) -> None:
        await self.redis.eval(_UNBIND_IF, 1, self._k("bindings"), node_id, *sorted(sandbox_ids))

    async def find(self, sandbox_id: str, node_ids: list[str]) -> str | None:
        """The node whose roster holds the sandbox (a binding lost or not yet written)."""
        async with self.redis.pipeline(transaction=False) as p:
            for nid in node_ids:
                p.hexists(self._k("roster", nid), sandbox_id)
            found = await p.execute()
        for nid, yes in zip(node_ids, found, strict=True):
            if yes:
                await self.bind(sandbox_id, nid)
                return nid
        return None

    # ------------------------------------------------------------------ templates
    async def template_node(self, template_id: str) -> str | None:
        return _text(await self.redis.hget(self._k("templates"), template_id))

    async def bind_template(self, template_id: str, node_id: str) -> None:
        await self.redis.hset(self._k("templates"), template_id, node_id)

    # ------------------------------------------------------------------ webhooks
    # A cluster's webhooks (docs/events.md): every node keeps a copy and delivers the
    # events it recorded, so each event goes out once. Gateways write here and to every
    # node; a node's heartbeat takes what it missed (a node that joined later, or was
    # away), and the ids of deleted ones.
    async def webhooks(self) -> tuple[dict[str, str], set[str]]:
        """Webhook documents by id, and the ids of deleted webhooks."""
        async with self.redis.pipeline(transaction=False) as p:
            p.hgetall(self._k("webhooks"))
            p.smembers(self._k("webhooks-deleted"))
            docs, gone = await p.execute()
        return dict(docs), set(gone)

    async def webhook(self, webhook_id: str) -> str | None:
        doc = await self.redis.hget(self._k("webhooks"), webhook_id)
        return None if doc is None else str(doc)

    async def put_webhook(self, webhook_id: str, doc: str) -> None:
        await self.redis.hset(self._k("webhooks"), webhook_id, doc)

    async def delete_webhook(self, webhook_id: str) -> bool:
        async with self.redis.pipeline(transaction=True) as p:
            p.hdel(self._k("webhooks"), webhook_id)
            p.sadd(self._k("webhooks-deleted"), webhook_id)
            n, _ = await p.execute()
        return bool(n)

    # ------------------------------------------------------------------ secrets
    # A cluster's secrets (docs/secrets.md): sealed entries (the nodes share their key), put
    # here by the node that made each change, taken by the others' heartbeats and before
    # they answer about secrets.
    async def secrets(self) -> tuple[dict[str, str], set[str]]:
        """Sealed secret entries by id, and the ids of deleted secrets."""
        async with self.redis.pipeline(transaction=False) as p:
            p.hgetall(self._k("secrets"))
            p.smembers(self._k("secrets-deleted"))
            docs, gone = await p.execute()
        return {str(_text(k)): str(_text(v)) for k, v in docs.items()}, {
            str(_text(g)) for g in gone
        }

    async def put_secret(self, secret_id: str, doc: str | None) -> None:
        """An entry's latest version; None: the secret was deleted."""
        if doc is not None:
            await self.redis.hset(self._k("secrets"), secret_id, doc)
            return
        async with self.redis.pipeline(transaction=True) as p:
            p.hdel(self._k("secrets"), secret_id)
            p.sadd(self._k("secrets-deleted"), secret_id)
            await p.execute()

    async def claim_lost(self, sandbox_id: str) -> bool:
        """Whether this caller is the first to report the sandbox lost with its node (the
        claim outlives the events' retention)."""
        return bool(await self.redis.set(self._k("lost", sandbox_id), "1", nx=True, ex=8 * 86400))

    async def unclaim_lost(self, sandbox_id: str) -> None:
        await self.redis.delete(self._k("lost", sandbox_id))
