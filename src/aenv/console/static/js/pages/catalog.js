// Templates (GET /templates) and snapshots (GET /snapshots, paged): what sandboxes start
// from. A sandbox can be started from either; a snapshot can be deleted.

import { api } from "../api.js";
import { age, confirmDialog, fmtTime, go, h, link, poll, replace, toast, toastError } from "../ui.js";
import { newSandbox } from "./sandboxes.js";

const REFRESH_MS = 5000;

function startButton(templateId) {
  return h(
    "button",
    {
      class: "btn btn-small",
      onclick: async () => {
        const created = await newSandbox(templateId);
        if (created) go(`sandboxes/${created.sandboxID}`);
      },
    },
    "New sandbox",
  );
}

function table(id, headers, rows, empty) {
  return h(
    "table",
    { class: "grid", id },
    h("thead", {}, h("tr", {}, headers.map((t) => h("th", {}, t)))),
    h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { colspan: headers.length, class: "empty" }, empty))),
  );
}

function statusBadge(status) {
  return h("span", { class: `badge build-${status}` }, status);
}

export function renderTemplates(main) {
  const body = h("div", { id: "templates-body" }, h("p", { class: "muted" }, "Loading…"));
  replace(main, h("div", { class: "page-head" }, h("h1", {}, "Templates")), body);

  async function refresh() {
    let items;
    let snapshots;
    try {
      [items, snapshots] = await Promise.all([api.get("/templates"), api.page("/snapshots", { limit: 1000 })]);
    } catch (err) {
      replace(body, h("p", { class: "error-text" }, `Cannot list templates: ${err.message}`));
      return;
    }
    // Snapshots are templates too (the API lists them with the rest): they have their page.
    const snapshotIds = new Set(snapshots.items.map((s) => s.snapshotID));
    items = items.filter((t) => !snapshotIds.has(t.templateID));
    items.sort((a, b) => (a.names?.[0] || a.templateID).localeCompare(b.names?.[0] || b.templateID));
    const rows = items.map((t) =>
      h(
        "tr",
        { dataset: { templateId: t.templateID } },
        h("td", {}, h("strong", {}, t.names?.[0] || t.aliases?.[0] || "–")),
        h("td", {}, h("code", {}, t.templateID)),
        h("td", {}, statusBadge(t.buildStatus || "ready")),
        h("td", {}, `${t.cpuCount} CPU · ${t.memoryMB} MiB · ${t.diskSizeMB} MiB disk`),
        h("td", {}, String(t.buildCount ?? 1)),
        h("td", { title: fmtTime(t.createdAt) }, `${age(t.createdAt)} ago`),
        h("td", {}, t.envdVersion || "–"),
        h("td", {}, (t.buildStatus || "ready") === "ready" ? startButton(t.names?.[0] || t.templateID) : null),
      ),
    );
    replace(
      body,
      table(
        "templates",
        ["Name", "Template ID", "Build", "Defaults", "Builds", "Created", "envd", ""],
        rows,
        "No templates yet: `aenv template build-base` builds the base one.",
      ),
      h(
        "p",
        { class: "muted small" },
        "Templates are built with the E2B SDKs' Template API or `aenv template build`. ",
        snapshotIds.size ? link("snapshots", `${snapshotIds.size} snapshot${snapshotIds.size === 1 ? "" : "s"}`) : null,
        snapshotIds.size ? " can be started from too." : null,
      ),
    );
  }

  return poll(refresh, REFRESH_MS);
}

export function renderSnapshots(main) {
  const body = h("div", { id: "snapshots-body" }, h("p", { class: "muted" }, "Loading…"));
  replace(main, h("div", { class: "page-head" }, h("h1", {}, "Snapshots")), body);

  async function listAll() {
    const out = [];
    let token = null;
    for (let i = 0; i < 20; i += 1) {
      const page = await api.page("/snapshots", { limit: 200, nextToken: token });
      out.push(...page.items);
      token = page.next;
      if (!token) break;
    }
    return out;
  }

  async function remove(s) {
    const name = s.names?.[0] || s.snapshotID;
    if (!(await confirmDialog("Delete this snapshot?", `${name}: sandboxes can no longer start from it.`, "Delete"))) return;
    try {
      await api.del(`/templates/${encodeURIComponent(s.snapshotID)}`);
      toast(`Deleted ${name}.`, "ok");
    } catch (err) {
      toastError(err, "Delete failed");
    }
    await refresh();
  }

  async function refresh() {
    let items;
    try {
      items = await listAll();
    } catch (err) {
      replace(body, h("p", { class: "error-text" }, `Cannot list snapshots: ${err.message}`));
      return;
    }
    items.reverse(); // newest first
    const rows = items.map((s) =>
      h(
        "tr",
        { dataset: { snapshotId: s.snapshotID } },
        h("td", {}, h("strong", {}, s.names?.[0] || "–")),
        h("td", {}, h("code", {}, s.snapshotID)),
        h("td", {}, h("span", { class: `badge mode-${s.mode || "full"}` }, s.mode || "full")),
        h("td", {}, s.sandboxID ? link(`sandboxes/${s.sandboxID}`, h("code", {}, s.sandboxID)) : "–"),
        h("td", { title: fmtTime(s.createdAt) }, s.createdAt ? `${age(s.createdAt)} ago` : "–"),
        h(
          "td",
          { class: "actions" },
          startButton(s.snapshotID),
          h("button", { class: "btn btn-small btn-danger", onclick: () => remove(s) }, "Delete"),
        ),
      ),
    );
    replace(
      body,
      table(
        "snapshots",
        ["Name", "Snapshot ID", "Kind", "From sandbox", "Taken", ""],
        rows,
        "No snapshots yet: take one from a sandbox's page.",
      ),
    );
  }

  return poll(refresh, REFRESH_MS);
}
