// The node(s): capacity and usage (GET /nodes, GET /nodes/{id}). A node answers E2B's
// Node shape; a gateway lists its nodes from their heartbeats (another shape): both shown.

import { api } from "../api.js";
import { age, badge, bar, fmtBytes, fmtTime, h, link, poll, replace, sandboxTemplate } from "../ui.js";

const REFRESH_MS = 2000;
const MIB = 1024 * 1024;

export function normalize(n) {
  const m = n.metrics;
  if (m) {
    return {
      id: n.nodeID || n.id,
      status: n.status,
      version: n.version,
      cpuCount: m.cpuCount,
      cpuPercent: m.cpuPercent,
      memTotal: m.memoryTotalBytes,
      memUsed: m.memoryUsedBytes,
      allocCpu: m.allocatedCPU,
      allocMem: m.allocatedMemoryBytes,
      budget: m.memoryBudgetBytes,
      pausedMem: m.pausedMemoryBytes,
      disks: m.disks || [],
      sandboxes: n.sandboxCount,
      starting: n.sandboxStartingCount,
      counts: n.sandboxCounts || {},
      machine: n.machineInfo,
      creates: [n.createSuccesses, n.createFails],
      since: n.statusChangedAt,
    };
  }
  return {
    id: n.nodeID || n.id,
    status: n.status,
    version: n.version,
    cpuCount: n.cpuCount,
    memTotal: (n.memoryMB || 0) * MIB,
    allocCpu: n.allocatedCPU,
    allocMem: (n.allocatedMemoryMB || 0) * MIB,
    free: n.freeMemoryMB !== undefined ? n.freeMemoryMB * MIB : undefined,
    sandboxes: n.sandboxCount,
    running: n.runningSandboxCount,
    url: n.url,
    heartbeatAt: n.heartbeatAt,
    disks: [],
    counts: {},
  };
}

function gauge(label, percent, text) {
  return h("div", { class: "usage-row" }, h("span", {}, label), bar(percent, text));
}

function nodeCard(raw, withLink) {
  const n = normalize(raw);
  const rows = [];
  if (n.cpuPercent !== undefined) {
    rows.push(gauge("CPU", n.cpuPercent, `${n.cpuPercent}% of ${n.cpuCount} cores`));
  }
  if (n.memUsed !== undefined) {
    rows.push(gauge("Memory", (100 * n.memUsed) / (n.memTotal || 1), `${fmtBytes(n.memUsed)} / ${fmtBytes(n.memTotal)} used`));
  }
  if (n.allocCpu !== undefined && n.cpuCount) {
    const ratio = n.allocCpu / n.cpuCount;
    rows.push(
      h(
        "div",
        { class: "usage-row" },
        h("span", {}, "vCPU given"),
        bar(100 * Math.min(1, ratio), `${n.allocCpu} vCPU to sandboxes on ${n.cpuCount} cores (${ratio.toFixed(1)}×)`, true),
      ),
    );
  }
  const budget = n.budget || n.memTotal;
  if (n.allocMem !== undefined && budget) {
    const paused = n.pausedMem ? ` (${fmtBytes(n.pausedMem)} paused)` : "";
    rows.push(gauge("Memory given", (100 * n.allocMem) / budget, `${fmtBytes(n.allocMem)} / ${fmtBytes(budget)} budget${paused}`));
  }
  for (const d of n.disks) {
    rows.push(gauge(`Disk ${d.mountPoint}`, (100 * d.usedBytes) / (d.totalBytes || 1), `${fmtBytes(d.usedBytes)} / ${fmtBytes(d.totalBytes)}`));
  }
  const counts = Object.entries(n.counts).filter(([, v]) => v);
  const facts = [
    [
      "Sandboxes",
      n.running !== undefined
        ? `${n.sandboxes ?? "–"} (${n.running} running)`
        : `${n.sandboxes ?? "–"} running${n.starting ? `, ${n.starting} starting (warm pool included)` : ""}`,
    ],
    counts.length ? ["By state", counts.map(([k, v]) => `${k.replace("paused_", "paused/")} ${v}`).join(" · ")] : null,
    n.machine ? ["Machine", `${n.machine.cpuModelName || n.machine.cpuModel || "?"} (${n.machine.cpuArchitecture || "?"})`] : null,
    n.creates ? ["Creates", `${n.creates[0]} ok · ${n.creates[1]} failed`] : null,
    n.url ? ["Address", n.url] : null,
    n.heartbeatAt ? ["Heartbeat", `${age(n.heartbeatAt)} ago`] : null,
    n.since ? ["Status since", fmtTime(n.since)] : null,
    ["Version", n.version || "–"],
  ].filter(Boolean);
  return h(
    "section",
    { class: "card node", dataset: { nodeId: n.id } },
    h(
      "div",
      { class: "card-head" },
      h("h2", {}, withLink ? link(`nodes/${encodeURIComponent(n.id)}`, n.id) : n.id),
      badge(n.status),
    ),
    h(
      "div",
      { class: "node-body" },
      h("div", { class: "usage" }, rows),
      h("dl", { class: "details" }, facts.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
    ),
  );
}

function sandboxesTable(sandboxes) {
  return h(
    "table",
    { class: "grid compact" },
    h("thead", {}, h("tr", {}, ["Sandbox", "Template", "State", "Age", "CPU", "Memory"].map((t) => h("th", {}, t)))),
    h(
      "tbody",
      {},
      sandboxes.length
        ? sandboxes.map((s) =>
            h(
              "tr",
              {},
              h("td", {}, link(`sandboxes/${s.sandboxID}`, h("code", {}, s.sandboxID))),
              h("td", {}, sandboxTemplate(s)),
              h("td", {}, badge(s.state)),
              h("td", {}, age(s.startedAt)),
              h("td", {}, `${s.cpuCount}`),
              h("td", {}, `${s.memoryMB} MiB`),
            ),
          )
        : h("tr", {}, h("td", { colspan: 6, class: "empty" }, "No sandboxes on this node.")),
    ),
  );
}

// A node's sandboxes (GET /nodes/{id}) under its card, for the first few nodes.
const DETAILED_NODES = 8;

export function render(main) {
  const body = h("div", { class: "nodes", id: "nodes" }, h("p", { class: "muted" }, "Loading…"));
  replace(main, h("div", { class: "page-head" }, h("h1", {}, "Nodes")), body);
  return poll(async () => {
    let nodes;
    try {
      nodes = await api.get("/nodes");
    } catch (err) {
      replace(body, h("p", { class: "error-text" }, `Cannot list nodes: ${err.message}`));
      return;
    }
    const details = await Promise.all(
      nodes.map((n, i) =>
        i < DETAILED_NODES ? api.get(`/nodes/${encodeURIComponent(n.nodeID || n.id)}`).catch(() => null) : null,
      ),
    );
    replace(
      body,
      nodes.length
        ? nodes.map((n, i) => {
            const card = nodeCard(n, true);
            const sandboxes = details[i]?.sandboxes;
            if (sandboxes) card.append(h("h3", {}, `Sandboxes (${sandboxes.length})`), sandboxesTable(sandboxes));
            return card;
          })
        : h("p", { class: "muted" }, "No nodes."),
    );
  }, REFRESH_MS);
}

export function renderNode(main, id) {
  const body = h("div", { id: "node" }, h("p", { class: "muted" }, "Loading…"));
  replace(
    main,
    h("div", { class: "crumbs" }, link("nodes", "Nodes"), " / ", id),
    h("div", { class: "page-head" }, h("h1", {}, "Node ", h("code", {}, id))),
    body,
  );
  return poll(async () => {
    let node;
    try {
      node = await api.get(`/nodes/${encodeURIComponent(id)}`);
    } catch (err) {
      replace(body, h("p", { class: "error-text" }, `Cannot read the node: ${err.message}`));
      return;
    }
    const sandboxes = node.sandboxes || [];
    replace(
      body,
      nodeCard(node, false),
      h("section", { class: "card" }, h("h2", {}, `Sandboxes on this node (${sandboxes.length})`), sandboxesTable(sandboxes)),
    );
  }, REFRESH_MS);
}
