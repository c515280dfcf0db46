"""The routes E2B's SDK 2.63 added to its API client, through the node's API over a real
orchestrator on the fake runtime: the template tag sub-routes (count, exists, groups, a tag's
assignments), `GET /default-templates`, `PATCH /v2/templates/{id}`, and the v2 listing's
`X-Total-Running`; each answer read with the SDK's own generated models."""

from __future__ import annotations

from typing import Any

import httpx
from e2b.api.client.models.template import Template
from e2b.api.client.models.template_tag_assignments_response import (
    TemplateTagAssignmentsResponse,
)
from e2b.api.client.models.template_tag_exists_response import TemplateTagExistsResponse
from e2b.api.client.models.template_tag_groups_response import TemplateTagGroupsResponse
from e2b.api.client.models.template_tags_count_response import TemplateTagsCountResponse
from e2b.api.client.models.template_update_response import TemplateUpdateResponse

from tests.node_harness import Harness
from tests.unit.api_node import assert_error, paused, running


async def _get(client: httpx.AsyncClient, path: str, **params: Any) -> Any:
    r = await client.get(path, params=params)
    assert r.status_code == 200, r.text
    return r.json()


async def test_tag_sub_routes(client: httpx.AsyncClient) -> None:
    base = "/templates/base/tags"
    # `base` has one tag until now: `default`, its one build.
    assert TemplateTagsCountResponse.from_dict(await _get(client, f"{base}/count")).total == 1
    for tags in (["v1"], ["v2"], ["v1"]):  # v1 assigned twice: two events
        r = await client.post("/templates/tags", json={"target": "base", "tags": tags})
        assert r.status_code == 201, r.text
    assert (await _get(client, f"{base}/count")) == {"total": 3}

    found = TemplateTagExistsResponse.from_dict(await _get(client, f"{base}/exists", tag=" v1 "))
    assert found.exists and found.normalized_tag == "v1"
    assert (await _get(client, f"{base}/exists", tag="v9")) == {
        "exists": False,
        "normalizedTag": "v9",
    }
    assert_error(await client.get(f"{base}/exists", params={"tag": "no way!"}), 400)

    # Groups: newest assignment first by default; v1's latest came last.
    doc = await _get(client, f"{base}/groups", assignmentLimit=1)
    groups = TemplateTagGroupsResponse.from_dict(doc)
    assert [g.tag for g in groups.tags] == ["v1", "v2", "default"]
    assert [len(g.assignments) for g in groups.tags] == [1, 1, 1]
    assert [g.has_more for g in groups.tags] == [True, False, False]
    assert groups.next_cursor is None
    assert [g["tag"] for g in (await _get(client, f"{base}/groups", sort="name_asc"))["tags"]] == [
        "default",
        "v1",
        "v2",
    ]
    assert [g["tag"] for g in (await _get(client, f"{base}/groups", search="V"))["tags"]] == [
        "v1",
        "v2",
    ]
    first = await _get(client, f"{base}/groups", tagsLimit=2, sort="latest_asc")
    assert [g["tag"] for g in first["tags"]] == ["default", "v2"] and first["nextCursor"]
    rest = await _get(
        client, f"{base}/groups", tagsLimit=2, sort="latest_asc", tagsCursor=first["nextCursor"]
    )
    assert [g["tag"] for g in rest["tags"]] == ["v1"] and rest["nextCursor"] is None
    assert_error(await client.get(f"{base}/groups", params={"tagsCursor": "bogus"}), 400)
    assert_error(await client.get(f"{base}/groups", params={"sort": "sideways"}), 400)

    # One tag's assignments, newest first, paged; every one on base's one build.
    page = TemplateTagAssignmentsResponse.from_dict(
        await _get(client, f"{base}/v1/assignments", limit=1)
    )
    assert len(page.data) == 1 and page.next_cursor
    nxt = await _get(client, f"{base}/v1/assignments", limit=1, cursor=page.next_cursor)
    assert len(nxt["data"]) == 1 and nxt["nextCursor"] is None
    events = [page.data[0], *TemplateTagAssignmentsResponse.from_dict(nxt).data]
    assert events[0].assigned_at >= events[1].assigned_at
    assert events[0].assignment_id != events[1].assignment_id
    assert len({e.build_id for e in events}) == 1
    assert all(e.build_finished_at is not None for e in events)

    # Removing a tag removes its history.
    r = await client.request("DELETE", "/templates/tags", json={"name": "base", "tags": ["v1"]})
    assert r.status_code == 204, r.text
    assert (await _get(client, f"{base}/count")) == {"total": 2}
    assert (await _get(client, f"{base}/v1/assignments")) == {"data": [], "nextCursor": None}
    assert_error(await client.get("/templates/nope/tags/count"), 404)


async def test_default_templates_and_the_v2_update(client: httpx.AsyncClient) -> None:
    listed = [Template.from_dict(d) for d in await _get(client, "/default-templates")]
    assert [(t.template_id, t.public) for t in listed] == [("base", True)]

    r = await client.patch("/v2/templates/base", json={"public": True})
    assert r.status_code == 200, r.text
    assert TemplateUpdateResponse.from_dict(r.json()).names == ["base"]
    r = await client.patch("/v2/templates/base", json={"standbyAfter": 30})
    assert r.status_code == 200 and r.json() == {"names": ["base"]}
    assert_error(await client.patch("/v2/templates/nope", json={"public": True}), 404)
    assert_error(await client.patch("/v2/templates/base", json={"public": "yes"}), 400)


async def test_v2_listing_counts_the_running_before_paging(
    client: httpx.AsyncClient, node: Harness
) -> None:
    for _ in range(3):
        await running(node, metadata={"suite": "total"})
    await paused(node, metadata={"suite": "total"})
    await running(node, metadata={"suite": "other"})
    r = await client.get("/v2/sandboxes", params={"metadata": "suite=total", "limit": 1})
    assert r.status_code == 200 and len(r.json()) == 1
    assert r.headers["X-Total-Running"] == "3"
    r = await client.get("/v2/sandboxes", params={"limit": 1})
    assert r.headers["X-Total-Running"] == "4"
    # Only when running sandboxes were asked for.
    r = await client.get("/v2/sandboxes", params={"state": "paused"})
    assert len(r.json()) == 1 and "X-Total-Running" not in r.headers
    asc = [s["sandboxID"] for s in (await client.get("/v2/sandboxes?order=asc")).json()]
    desc = [s["sandboxID"] for s in (await client.get("/v2/sandboxes?order=desc")).json()]
    assert asc == desc[::-1] and len(asc) == 5
