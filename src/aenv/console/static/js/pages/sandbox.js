// One sandbox: its metadata (GET /sandboxes/{id}), live usage, logs (GET
// /v2/sandboxes/{id}/logs), the lifecycle buttons, a terminal over its PTY, and its place in
// the fork tree (GET /sandboxes/{id}/lineage) with what it changed (GET /sandboxes/{id}/diff).

import { api } from "../api.js";
import { TerminalPanel } from "../terminal.js";
import {
  age,
  badge,
  bar,
  confirmDialog,
  dialog,
  fmtBytes,
  fmtTime,
  go,
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

const REFRESH_MS = 2000;

export function render(main, id) {
  const path = `/sandboxes/${encodeURIComponent(id)}`;
  let info = null;
  let gone = false;
  let terminal = null;

  const title = h("h1", {}, "Sandbox ", h("code", {}, id));
  const stateBadge = h("span", { id: "sandbox-state" });
  const buttons = {
    pause: h("button", { class: "btn", id: "btn-pause", title: "Freeze it; memory and processes are kept" }, "Pause"),
    resume: h("button", { class: "btn", id: "btn-resume" }, "Resume"),
    snapshot: h("button", { class: "btn", id: "btn-snapshot" }, "Snapshot"),
    fork: h("button", { class: "btn", id: "btn-fork" }, "Fork"),
    timeout: h("button", { class: "btn", id: "btn-timeout" }, "Timeout…"),
    kill: h("button", { class: "btn btn-danger", id: "btn-kill" }, "Kill"),
  };
  const details = h("dl", { class: "details", id: "sandbox-details" });
  const usage = h("div", { class: "usage", id: "sandbox-usage" }, h("span", { class: "muted" }, "…"));
  const termHost = h("div", { class: "term-host", id: "terminal-host" });
  const termUser = h(
    "select",
    { id: "terminal-user", title: "Run the shell as" },
    h("option", { value: "" }, "default user"),
    h("option", { value: "root" }, "root"),
  );
  const openTerm = h("button", { class: "btn btn-primary", id: "btn-terminal" }, "Open terminal");
  const logs = h("div", { class: "logs", id: "sandbox-logs" });
  const tree = h("div", { class: "lineage", id: "sandbox-lineage" }, h("span", { class: "muted" }, "…"));
  const showChanges = h(
    "button",
    { class: "btn", id: "btn-changes", title: "What it changed since its fork point: files and a patch" },
    "Changes",
  );
  const changes = h("div", { class: "changes", id: "sandbox-changes" });
  const follow = h("input", { type: "checkbox", checked: true, id: "logs-follow" });

  replace(
    main,
    h("div", { class: "crumbs" }, link("sandboxes", "Sandboxes"), " / ", id),
    h("div", { class: "page-head" }, title, stateBadge, h("div", { class: "spacer" }), Object.values(buttons)),
    h(
      "div",
      { class: "columns" },
      h("section", { class: "card" }, h("h2", {}, "Details"), details),
      h("section", { class: "card" }, h("h2", {}, "Usage"), usage),
    ),
    h(
      "section",
      { class: "card" },
      h("div", { class: "card-head" }, h("h2", {}, "Lineage"), h("div", { class: "spacer" }), showChanges),
      tree,
      changes,
    ),
    h(
      "section",
      { class: "card" },
      h("div", { class: "card-head" }, h("h2", {}, "Terminal"), h("div", { class: "spacer" }), termUser, openTerm),
      termHost,
    ),
    h(
      "section",
      { class: "card" },
      h("div", { class: "card-head" }, h("h2", {}, "Logs"), h("div", { class: "spacer" }), h("label", { class: "check" }, follow, " follow")),
      logs,
    ),
  );

  // -- state ------------------------------------------------------------------------

  function setButtons() {
    const state = gone ? "gone" : info?.state;
    const busy = main.dataset.busy === "1";
    buttons.pause.disabled = busy || state !== "running";
    buttons.resume.disabled = busy || state !== "paused";
    for (const b of [buttons.snapshot, buttons.fork]) b.disabled = busy || !info || gone;
    buttons.timeout.disabled = busy || state !== "running";
    buttons.kill.disabled = busy || gone || !info;
    openTerm.disabled = state !== "running" || Boolean(terminal);
  }

  function showDetails(s) {
    const rows = [
      ["Template", sandboxTemplate(s) + (s.alias && s.alias !== s.templateID ? ` (${s.templateID})` : "")],
      ["Started", `${fmtTime(s.startedAt)} (${age(s.startedAt)} ago)`],
      ["Ends", s.state === "paused" ? "– (paused)" : `${fmtTime(s.endAt)} (${until(s.endAt)})`],
      ["On timeout", s.lifecycle ? `${s.lifecycle.onTimeout}${s.lifecycle.autoResume ? ", auto-resume" : ""}` : "–"],
      ["CPU / memory / disk", `${s.cpuCount} CPU · ${s.memoryMB} MiB · ${s.diskSizeMB} MiB disk`],
      ["envd", s.envdVersion],
      ["Internet", s.allowInternetAccess === false ? "no" : "yes"],
      ["Network", networkText(s.network)],
      ["Domain", s.domain || "–"],
      ["Volumes", (s.volumeMounts || []).map((v) => `${v.name} → ${v.path}${v.readOnly ? " (ro)" : ""}`).join(", ") || "–"],
    ];
    const meta = Object.entries(s.metadata || {});
    replace(
      details,
      rows.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v ?? "–")]),
      h("dt", {}, "Metadata"),
      h("dd", {}, meta.length ? meta.map(([k, v]) => h("span", { class: "chip" }, `${k}=${v}`)) : "–"),
    );
  }

  function networkText(n) {
    if (!n) return "–";
    const parts = [n.allowPublicTraffic ? "public ports" : "ports need the traffic token"];
    if (n.allowOut?.length) parts.push(`allow ${n.allowOut.join(", ")}`);
    if (n.denyOut?.length) parts.push(`deny ${n.denyOut.join(", ")}`);
    return parts.join(" · ");
  }

  async function refresh() {
    if (gone) return;
    try {
      info = await api.get(path);
    } catch (err) {
      if (err.status === 404) {
        gone = true;
        replace(stateBadge, badge("gone"));
        replace(usage, h("span", { class: "muted" }, "This sandbox is gone (killed or timed out)."));
        terminal?.dispose();
        setButtons();
        return;
      }
      throw err;
    }
    replace(stateBadge, badge(info.state));
    main.dataset.state = info.state;
    showDetails(info);
    setButtons();
    if (info.state === "running") {
      const m = (await api.get("/sandboxes/metrics", { sandbox_ids: id }).catch(() => null))?.sandboxes?.[id];
      showUsage(m);
      if (terminal?.detached && !terminal.reattaching) {
        terminal.reattaching = true;
        terminal.reattach().finally(() => {
          if (terminal) terminal.reattaching = false;
        });
      }
    } else {
      replace(usage, h("span", { class: "muted" }, "Paused: no CPU in use; resume it to use it again."));
    }
  }

  function showUsage(m) {
    if (!m) {
      replace(usage, h("span", { class: "muted" }, "No sample yet."));
      return;
    }
    replace(
      usage,
      h("div", { class: "usage-row" }, h("span", {}, "CPU"), bar(m.cpuUsedPct, `${pct(m.cpuUsedPct)} of ${m.cpuCount} CPU`)),
      h("div", { class: "usage-row" }, h("span", {}, "Memory"), bar((100 * m.memUsed) / (m.memTotal || 1), `${fmtBytes(m.memUsed)} / ${fmtBytes(m.memTotal)}`)),
      h("div", { class: "usage-row" }, h("span", {}, "Disk"), bar((100 * m.diskUsed) / (m.diskTotal || 1), `${fmtBytes(m.diskUsed)} / ${fmtBytes(m.diskTotal)}`)),
      h("p", { class: "muted small" }, `sampled ${fmtTime(m.timestamp)}`),
    );
  }

  // -- the fork tree ----------------------------------------------------------------

  function how(l) {
    if (!l) return "";
    if (l.parentID) return "fork";
    if (l.snapshotID) return `from snapshot ${l.snapshotID}`;
    return l.templateID ? `from ${l.templateID}` : "";
  }

  function item(n, children) {
    const name =
      n.sandboxID === id
        ? h("strong", {}, n.sandboxID, " (this)")
        : n.state === "killed"
          ? h("span", { class: "muted" }, n.sandboxID)
          : link(`sandboxes/${n.sandboxID}`, n.sandboxID);
    return h(
      "li",
      { "data-sandbox": n.sandboxID },
      name,
      h("span", { class: "muted" }, ` ${n.state || ""} ${how(n.lineage)}`),
      children?.length ? h("ul", {}, children) : null,
    );
  }

  function below(nodes) {
    return (nodes || []).map((d) => item(d, below(d.children)));
  }

  async function refreshLineage() {
    const t = await api.get(`${path}/lineage`).catch(() => null);
    if (!t) return;
    let inner = [item({ sandboxID: id, state: info?.state, lineage: t.lineage }, below(t.descendants))];
    for (const a of [...(t.ancestors || [])].reverse()) inner = [item(a, inner)];
    const root = t.ancestors?.[0]?.lineage?.templateID || t.lineage?.templateID;
    replace(tree, h("ul", { class: "tree" }, root ? h("li", {}, h("code", {}, root), h("ul", {}, inner)) : inner));
  }

  showChanges.addEventListener("click", async () => {
    replace(changes, h("span", { class: "muted" }, "…"));
    try {
      const list = await api.get(`${path}/diff`);
      const patch = list.length ? await api.text(`${path}/diff`, { format: "patch" }) : "";
      const letter = { added: "A", changed: "M", deleted: "D" };
      replace(
        changes,
        list.length
          ? h(
              "table",
              { class: "grid", id: "changes-list" },
              list.map((c) => h("tr", {}, h("td", {}, letter[c.change]), h("td", {}, h("code", {}, c.path)), h("td", {}, c.type === "file" ? fmtBytes(c.size) : c.type))),
            )
          : h("p", { class: "muted" }, "No changes since its fork point."),
        patch ? h("pre", { class: "patch", id: "changes-patch" }, patch) : null,
      );
    } catch (err) {
      replace(changes, h("p", { class: "muted", id: "changes-error" }, err.message));
    }
  });

  // -- logs -------------------------------------------------------------------------

  const seen = new Set();
  let cursor = null;
  async function refreshLogs() {
    if (gone) return;
    const body = await api.get(`/v2${path}/logs`, { cursor, limit: 1000, direction: "forward" });
    const fresh = [];
    for (const e of body?.logs || []) {
      const key = `${e.timestamp}|${e.message}`;
      if (seen.has(key)) continue;
      seen.add(key);
      fresh.push(e);
      cursor = Date.parse(e.timestamp);
    }
    if (!fresh.length) {
      if (!logs.childElementCount) logs.append(h("div", { class: "muted log-empty" }, "No log lines yet."));
      return;
    }
    logs.querySelector(".log-empty")?.remove();
    for (const e of fresh) {
      const fields = Object.entries(e.fields || {}).filter(([k]) => k !== "sandbox_id");
      logs.append(
        h(
          "div",
          { class: `log log-${e.level}` },
          h("span", { class: "log-time" }, new Date(e.timestamp).toLocaleTimeString()),
          h("span", { class: "log-level" }, e.level),
          h("span", { class: "log-msg" }, e.message),
          fields.length ? h("span", { class: "log-fields" }, fields.map(([k, v]) => `${k}=${v}`).join(" ")) : null,
        ),
      );
    }
    if (follow.checked) logs.scrollTop = logs.scrollHeight;
  }

  // -- actions ----------------------------------------------------------------------

  async function act(button, busyLabel, fn) {
    const label = button.textContent;
    main.dataset.busy = "1";
    button.textContent = busyLabel;
    setButtons();
    try {
      await fn();
    } catch (err) {
      toastError(err, `${label} failed`);
    } finally {
      button.textContent = label;
      main.dataset.busy = "";
      await refresh().catch(() => {});
      await refreshLineage();
      setButtons();
    }
  }

  buttons.pause.addEventListener("click", () =>
    act(buttons.pause, "Pausing…", async () => {
      await api.post(`${path}/pause`);
      toast("Paused.", "ok");
    }),
  );
  buttons.resume.addEventListener("click", () =>
    act(buttons.resume, "Resuming…", async () => {
      await api.post(`/v2${path}/connect`, {});
      toast("Resumed.", "ok");
    }),
  );
  buttons.snapshot.addEventListener("click", async () => {
    const v = await dialog({
      title: "Snapshot",
      text: "A template new sandboxes can start from. Full: memory and processes too (they continue where this one is); files: the file system only.",
      confirm: "Take snapshot",
      fields: [
        { name: "name", label: "Name (optional)", placeholder: "my-snapshot" },
        { name: "mode", label: "Kind", options: [{ value: "full", label: "full (memory and files)" }, { value: "files", label: "files only" }], value: "full" },
      ],
    });
    if (!v) return;
    act(buttons.snapshot, "Snapshotting…", async () => {
      const body = { memory: v.mode === "full" };
      if (v.name.trim()) body.name = v.name.trim();
      const snap = await api.post(`${path}/snapshots`, body);
      toast(`Snapshot ${snap.names?.[0] || snap.snapshotID} taken.`, "ok");
    });
  });
  buttons.fork.addEventListener("click", async () => {
    const v = await dialog({
      title: "Fork",
      text: "Copies of this sandbox as it is now: memory, processes and files.",
      confirm: "Fork",
      fields: [{ name: "count", label: "How many (1–20)", type: "number", value: 1, min: 1, max: 20 }],
    });
    if (!v) return;
    act(buttons.fork, "Forking…", async () => {
      const results = await api.post(`${path}/fork`, { count: Math.max(1, Math.min(20, Number(v.count) || 1)) });
      const made = results.filter((r) => r.sandbox).map((r) => r.sandbox.sandboxID);
      const failed = results.filter((r) => r.error);
      if (made.length) {
        const el = toast(`Forked: ${made.join(", ")}`, "ok", 10000);
        el.firstChild.replaceChildren("Forked: ", ...made.flatMap((sid, i) => [i ? ", " : "", link(`sandboxes/${sid}`, sid)]));
      }
      for (const f of failed) toastError(f.error, "A fork child failed");
    });
  });
  buttons.timeout.addEventListener("click", async () => {
    const v = await dialog({
      title: "Set timeout",
      text: "Seconds from now until the sandbox times out.",
      confirm: "Set",
      fields: [{ name: "timeout", label: "Seconds", type: "number", value: 300, min: 1 }],
    });
    if (!v) return;
    act(buttons.timeout, "Setting…", async () => {
      await api.post(`${path}/timeout`, { timeout: Number(v.timeout) || 300 });
      toast("Timeout set.", "ok");
    });
  });
  buttons.kill.addEventListener("click", async () => {
    if (!(await confirmDialog("Kill this sandbox?", `${id} and everything in it are removed. This cannot be undone.`, "Kill"))) return;
    act(buttons.kill, "Killing…", async () => {
      await api.del(path);
      toast(`Killed ${id}.`, "ok");
      go("sandboxes");
    });
  });
  openTerm.addEventListener("click", async () => {
    terminal = new TerminalPanel(termHost, {
      sandboxId: id,
      user: termUser.value,
      getToken: async () => (await api.get(path)).envdAccessToken,
    });
    terminal.onClose = () => {
      terminal = null;
      setButtons();
    };
    setButtons();
    await terminal.open();
  });

  setButtons();
  refreshLineage();
  const stops = [poll(refresh, REFRESH_MS), poll(refreshLogs, REFRESH_MS)];
  return () => {
    for (const stop of stops) stop();
    terminal?.dispose();
  };
}
