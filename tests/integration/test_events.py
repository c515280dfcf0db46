"""Lifecycle events and webhooks on a real node with the stock E2B SDK: a webhook registered
with E2B's route gets a real sandbox's created, paused, resumed and killed events, signed
as E2B signs them (checked with their docs' verification code) and in order, and the same
events are listed by E2B's events route."""

from __future__ import annotations

import time
from typing import Any

import pytest
from e2b import Sandbox

from tests.integration.conftest import Server
from tests.webhook_receiver import receiving

pytestmark = pytest.mark.integration

LC = "sandbox.lifecycle."


def test_a_sandboxs_life_reaches_a_webhook_signed_and_in_order(
    e2b_env: Server, sandboxes: list[Any]
) -> None:
    with receiving() as rcv, e2b_env.client() as c:
        made = c.post(
            "/events/webhooks",
            json={
                "name": "integration",
                "url": rcv.url,
                "enabled": True,
                "events": [LC + t for t in ("created", "paused", "resumed", "killed")],
                "signatureSecret": rcv.secret,
            },
        )
        assert made.status_code == 201, made.text
        try:
            started = time.monotonic()
            sbx = Sandbox.create(template="base", timeout=120)
            sandboxes.append(sbx)
            assert sbx.commands.run("echo hi").stdout.strip() == "hi"
            assert sbx.pause()
            back = Sandbox.connect(sbx.sandbox_id)
            assert back.commands.run("echo again").stdout.strip() == "again"
            back.kill()
            took = time.monotonic() - started

            got = rcv.wait_for(4, timeout=30)
            mine = [e for e in got if e["sandboxId"] == sbx.sandbox_id]
            assert [e["type"] for e in mine] == [
                LC + t for t in ("created", "paused", "resumed", "killed")
            ]
            assert all(r.signed for r in rcv.accepted)
            assert {r.headers["e2b-webhook-id"] for r in rcv.accepted} == {made.json()["id"]}
            killed = mine[-1]["eventData"]
            assert killed["kill_reason"] == "request"
            assert killed["execution"]["memory_mb"] == 512
            assert mine[1]["eventData"]["pause_tier"] == "frozen"

            listed = c.get(f"/events/sandboxes/{sbx.sandbox_id}", params={"orderAsc": "true"})
            assert listed.json() == mine
            stats = c.get(f"/events/webhooks/{made.json()['id']}/stats").json()
            assert stats["delivered"] >= 4 and stats["backlog"] == 0
            print(f"create→pause→resume→kill took {took:.2f} s with a webhook")
        finally:
            c.delete(f"/events/webhooks/{made.json()['id']}")
