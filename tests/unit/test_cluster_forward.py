"""The gateway's client to nodes, against a real node-like server on loopback: a request
passed through (streamed both ways, the client's Host kept), one sent and read whole (the
client's Host also as X-Forwarded-Host), a call of the gateway's own (the caller's key, the
node's errors kept as they were), and a node that takes no connection (502)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from aenv.cluster.forward import NodeClient, NodeError, NodeUnreachable
from aenv.cluster.records import NodeRecord
from tests.helpers import free_port, uvicorn_task

BODY = bytes(range(256)) * 400  # 100 KiB, every byte value


async def echo(request: Request) -> Response:
    body = await request.body()
    return JSONResponse(
        {
            "method": request.method,
            "path": request.url.path,
            "query": request.url.query,
            "host": request.headers.get("host"),
            "forwarded_host": request.headers.get("x-forwarded-host"),
            "api_key": request.headers.get("x-api-key"),
            "length": len(body),
            "intact": body == BODY,
            "json": (await request.json()) if body and not body.startswith(b"\x00") else None,
        },
        status_code=201,
        headers={"x-node": "n1"},
    )


async def busy(_request: Request) -> Response:
    return JSONResponse({"code": 409, "message": "the node is draining"}, status_code=409)


async def broken(_request: Request) -> Response:
    return PlainTextResponse("boom", status_code=500)


async def listing(_request: Request) -> Response:
    return JSONResponse([{"id": "s1"}])


NODE_APP = Starlette(
    routes=[
        Route("/echo", echo, methods=["GET", "POST"]),
        Route("/busy", busy, methods=["POST"]),
        Route("/broken", broken),
        Route("/list", listing),
    ]
)


def gateway_app(client: NodeClient, node: NodeRecord) -> Starlette:
    async def through(request: Request) -> Response:
        if request.headers.get("x-mode") == "send":
            resp = await client.send(request, node)
            return Response(resp.content, resp.status_code, media_type="application/json")
        return client.passthrough(request, node)

    return Starlette(routes=[Route("/echo", through, methods=["GET", "POST"])])


@contextlib.asynccontextmanager
async def cluster() -> AsyncIterator[tuple[NodeClient, NodeRecord, str]]:
    client = NodeClient()
    try:
        async with uvicorn_task(NODE_APP) as node_port:
            node = NodeRecord(node_id="n1", url=f"http://127.0.0.1:{node_port}")
            async with uvicorn_task(gateway_app(client, node)) as gw_port:
                yield client, node, f"http://127.0.0.1:{gw_port}"
    finally:
        await client.aclose()


async def test_a_request_passes_through_as_it_came() -> None:
    async with cluster() as (_, _, gw), httpx.AsyncClient(base_url=gw) as http:
        r = await http.post("/echo?x=1&y=two", content=BODY, headers={"host": "gw.example.test"})
    assert r.status_code == 201 and r.headers["x-node"] == "n1"
    seen = r.json()
    assert (seen["method"], seen["path"], seen["query"]) == ("POST", "/echo", "x=1&y=two")
    assert seen["host"] == "gw.example.test"  # URLs the node builds lead back to the gateway
    assert seen["length"] == len(BODY) and seen["intact"]


async def test_a_request_sent_and_read_whole_keeps_the_clients_host() -> None:
    async with cluster() as (_, _, gw), httpx.AsyncClient(base_url=gw) as http:
        r = await http.post(
            "/echo?q=1",
            content=BODY,
            headers={"host": "gw.example.test", "x-mode": "send"},
        )
    seen = r.json()
    assert r.status_code == 201 and seen["query"] == "q=1" and seen["intact"]
    assert seen["host"] == seen["forwarded_host"] == "gw.example.test"


async def test_the_gateways_own_calls() -> None:
    async with cluster() as (client, node, _):
        seen = await client.call(node, "POST", "/echo", api_key="k-1", body={"a": 1})
        assert (seen["api_key"], seen["json"]) == ("k-1", {"a": 1})
        assert await client.call(node, "GET", "/list", api_key=None) == {"items": [{"id": "s1"}]}
        with pytest.raises(NodeError) as busy_err:
            await client.call(node, "POST", "/busy", api_key="k-1")
        # The node's answer is the client's: its status and its body, unchanged.
        assert busy_err.value.status == 409
        assert busy_err.value.to_json() == {"code": 409, "message": "the node is draining"}
        with pytest.raises(NodeError) as broken_err:
            await client.call(node, "GET", "/broken", api_key=None)
        assert broken_err.value.status == 500
        assert broken_err.value.to_json() == {"code": 500, "message": "boom"}


async def test_a_node_that_takes_no_connection_is_a_502() -> None:
    gone = NodeRecord(node_id="gone", url=f"http://127.0.0.1:{free_port()}")
    client = NodeClient()
    try:
        with pytest.raises(NodeUnreachable) as err:
            await client.call(gone, "GET", "/list", api_key=None)
        assert err.value.status == 502 and "'gone'" in str(err.value)
        async with uvicorn_task(gateway_app(client, gone)) as port, httpx.AsyncClient() as http:
            r = await http.get(f"http://127.0.0.1:{port}/echo")
        body: dict[str, Any] = r.json()
        assert r.status_code == 502 and body["message"].startswith("node 'gone' is unreachable")
    finally:
        await client.aclose()
