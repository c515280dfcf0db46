// The sandboxes: state, template, age and live CPU/memory (GET /v2/sandboxes and
// GET /sandboxes/metrics, every 2 s), paged, and a "New sandbox" dialog.

import { api } from "../api.js";
import {
  age,
  badge,
  bar,
  dialog,
  fmtBytes,
  h,
  link,
  pct,
  poll,
  replace,
  sandboxTemplate,
  toast,
  toastError,
  until,
} from "../ui.js";

const PAGE_SIZE = 50;
const REFRESH_MS = 2000;

// Templates to start a sandbox from: their names (or ids), and snapshots after them.
export async function templateChoices() {
  const [templates, snapshots] = await Promise.all([
    api.get("/templates").catch(() => []),
    api.get("/snapshots").catch(() => []),
  ]);
  const out = [];
  for (const t of templates) {
    if (t.buildStatus && t.buildStatus !== "ready") continue;
    const name = t.names?.[0] || t.aliases?.[0] || t.templateID;
    out.push({ value: name, label: name === t.templateID ? name : `${name} (${t.templateID})` });
  }
  for (const s of snapshots) {
    const name = s.names?.[0] || s.snapshotID;
    out.push({ value: s.snapshotID, label: `snapshot ${name} (${s.mode || "full"})` });
  }
  return out;
}

// The "New sandbox" dialog; resolves to the created sandbox or null.
export async function newSandbox(preset) {
  const choices = await templateChoices();
  if (preset && !choices.some((c) => c.value === preset)) choices.unshift({ value: preset });
  if (!choices.length) choices.push({ value: "base" });
  const values = await dialog({
    title: "New sandbox",
    confirm: "Create",
    fields: [
      { name: "template", label: "Template", options: choices, value: preset || choices[0].value },
      { name: "timeout", label: "Timeout (seconds)", type: "number", value: 300, min: 1 },
    ],
  });
  if (!values) return null;
  try {
    const created = await api.post("/v2/sandboxes", {
      templateID: values.template,
      timeout: Number(values.timeout) || 300,
    });
    toast(`Created sandbox ${created.sandboxID}.`, "ok");
    return created;
  } catch (err) {
    toastError(err, "Create failed");
    return null;
  }
}

export function render(main) {
  const state = { filter: "running,paused", tokens: [null], index: 0, highlight: null };
  const tbody = h("tbody", { id: "sandbox-rows" });
  const status = h("span", { class: "muted", id: "list-status" }, "Loading…");
  const prev = h("button", { class: "btn", disabled: true }, "← Previous");
  const next = h("button", { class: "btn", disabled: true }, "Next →");
  const filter = h(
    "select",
    { id: "state-filter", title: "State" },
    h("option", { value: "running,paused" }, "Running and paused"),
    h("option", { value: "running" }, "Running"),
    h("option", { value: "paused" }, "Paused"),
  );
  const create = h("button", { class: "btn btn-primary", id: "new-sandbox" }, "+ New sandbox");

  replace(
    main,
    h("div", { class: "page-head" }, h("h1", {}, "Sandboxes"), h("div", { class: "spacer" }), filter, create),
    h(
      "table",
      { class: "grid", id: "sandboxes" },
      h(
        "thead",
        {},
        h(
          "tr",
          {},
          ["Sandbox", "Template", "State", "Age", "CPU", "Memory", "Ends"].map((t) => h("th", {}, t)),
        ),
      ),
      tbody,
    ),
    h("div", { class: "pager" }, status, h("div", { class: "spacer" }), prev, next),
  );

  async function refresh() {
    let page;
    try {
      page = await api.page("/v2/sandboxes", {
        state: state.filter,
        limit: PAGE_SIZE,
        nextToken: state.tokens[state.index],
      });
    } catch (err) {
      status.textContent = `Cannot list sandboxes: ${err.message}`;
      status.className = "error-text";
      return;
    }
    const running = page.items.filter((s) => s.state === "running").map((s) => s.sandboxID);
    let metrics = {};
    if (running.length) {
      metrics = (await api.get("/sandboxes/metrics", { sandbox_ids: running.join(",") }).catch(() => null))
        ?.sandboxes || {};
    }
    replace(tbody, page.items.length ? page.items.map((s) => row(s, metrics[s.sandboxID])) : emptyRow());
    state.tokens[state.index + 1] = page.next;
    prev.disabled = state.index === 0;
    next.disabled = !page.next;
    status.className = "muted";
    const n = page.items.length;
    status.textContent = `${n} sandbox${n === 1 ? "" : "es"} on this page · updated ${new Date().toLocaleTimeString()}`;
  }

  function row(s, m) {
    const memLimit = m?.memTotal || s.memoryMB * 1024 * 1024;
    return h(
      "tr",
      { dataset: { sandboxId: s.sandboxID, state: s.state }, class: s.sandboxID === state.highlight ? "fresh" : null },
      h("td", {}, link(`sandboxes/${s.sandboxID}`, h("code", {}, s.sandboxID))),
      h("td", {}, sandboxTemplate(s)),
      h("td", {}, badge(s.state)),
      h("td", { title: s.startedAt }, age(s.startedAt)),
      h("td", { class: "metric" }, m ? bar(m.cpuUsedPct, `${pct(m.cpuUsedPct)} of ${m.cpuCount} CPU`) : `${s.cpuCount} CPU`),
      h(
        "td",
        { class: "metric" },
        m
          ? bar((100 * m.memUsed) / memLimit, `${fmtBytes(m.memUsed)} / ${fmtBytes(memLimit)}`)
          : fmtBytes(memLimit),
      ),
      h("td", { title: s.endAt }, s.state === "paused" ? "–" : until(s.endAt)),
    );
  }

  function emptyRow() {
    return h("tr", {}, h("td", { colspan: 7, class: "empty" }, "No sandboxes. Create one with “New sandbox”."));
  }

  const restart = () => {
    stop();
    stop = poll(refresh, REFRESH_MS);
  };
  filter.addEventListener("change", () => {
    state.filter = filter.value;
    state.tokens = [null];
    state.index = 0;
    restart();
  });
  prev.addEventListener("click", () => {
    state.index = Math.max(0, state.index - 1);
    restart();
  });
  next.addEventListener("click", () => {
    if (!state.tokens[state.index + 1]) return;
    state.index += 1;
    restart();
  });
  create.addEventListener("click", async () => {
    const created = await newSandbox();
    if (created) {
      state.highlight = created.sandboxID;
      restart();
    }
  });

  let stop = poll(refresh, REFRESH_MS);
  return () => stop();
}
