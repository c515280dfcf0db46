// The console's shell: login with an API key, the navigation, and a router over the
// History API (page paths are served index.html by the server, so reloads and links work).

import { clearKey, getKey, request, setKey } from "./api.js";
import { h, replace, toast } from "./ui.js";
import * as catalog from "./pages/catalog.js";
import * as nodes from "./pages/nodes.js";
import * as sandbox from "./pages/sandbox.js";
import * as sandboxes from "./pages/sandboxes.js";

const base = new URL(document.baseURI).pathname; // "/console/"
const app = document.getElementById("app");
let dispose = null;

const ROUTES = [
  [/^(?:sandboxes)?$/, sandboxes.render, "sandboxes"],
  [/^sandboxes\/([A-Za-z0-9_-]+)$/, sandbox.render, "sandboxes"],
  [/^templates$/, catalog.renderTemplates, "templates"],
  [/^snapshots$/, catalog.renderSnapshots, "snapshots"],
  [/^nodes$/, nodes.render, "nodes"],
  [/^nodes\/([^/]+)$/, nodes.renderNode, "nodes"],
];

const NAV = [
  ["sandboxes", "Sandboxes"],
  ["templates", "Templates"],
  ["snapshots", "Snapshots"],
  ["nodes", "Nodes"],
];

function navigate(path, { replaceState = false } = {}) {
  // Page paths are relative to the console's root ("sandboxes/ID"), or absolute.
  const url = new URL(path, new URL(base, location.origin));
  if (replaceState) history.replaceState(null, "", url);
  else history.pushState(null, "", url);
  route();
}

function relativePath() {
  const path = decodeURIComponent(location.pathname);
  const rest = path.startsWith(base) ? path.slice(base.length) : path.replace(/^\//, "");
  return rest.replace(/\/+$/, "");
}

function route() {
  if (dispose) {
    dispose();
    dispose = null;
  }
  if (!getKey()) {
    renderLogin();
    return;
  }
  const path = relativePath();
  for (const [pattern, render, section] of ROUTES) {
    const m = path.match(pattern);
    if (m) {
      const main = layout(section);
      dispose = render(main, ...m.slice(1)) || null;
      return;
    }
  }
  const main = layout("");
  replace(main, h("div", { class: "empty" }, h("h1", {}, "Not found"), h("p", {}, `No page ${path}.`)));
}

function layout(section) {
  const main = h("main", { id: "main" });
  const header = h(
    "header",
    { class: "topbar" },
    h("a", { class: "brand", href: base, "data-link": "" }, h("span", { class: "logo" }, "◆"), "aenv"),
    h(
      "nav",
      {},
      NAV.map(([id, label]) =>
        h("a", { href: `${base}${id}`, "data-link": "", class: id === section ? "active" : null }, label),
      ),
    ),
    h("div", { class: "spacer" }),
    h("span", { class: "origin", title: "API server" }, location.host),
    h("button", { class: "btn btn-ghost", id: "logout", onclick: logout }, "Log out"),
  );
  replace(app, header, main);
  return main;
}

function logout() {
  clearKey();
  toast("Logged out.");
  navigate(base, { replaceState: true });
}

function renderLogin(message) {
  const error = h("p", { class: "login-error", id: "login-error", role: "alert" }, message || "");
  const key = h("input", {
    id: "api-key",
    name: "key",
    type: "password",
    autocomplete: "current-password",
    placeholder: "e2b_…",
    required: true,
  });
  const remember = h("input", { id: "remember", type: "checkbox" });
  const submit = h("button", { type: "submit", class: "btn btn-primary", id: "login" }, "Log in");
  const form = h(
    "form",
    { class: "login", id: "login-form" },
    h("h1", {}, h("span", { class: "logo" }, "◆"), " aenv console"),
    h("p", { class: "muted" }, "Sandboxes, templates, snapshots and nodes of this server."),
    h("label", { class: "field" }, h("span", {}, "API key"), key),
    h("label", { class: "check" }, remember, " Remember on this browser"),
    error,
    submit,
    h(
      "p",
      { class: "muted small" },
      "A key from ",
      h("code", {}, "aenv keys create NAME"),
      " (or the node's first one, in ",
      h("code", {}, "$AENV_HOME/secrets/api-key"),
      "). The browser sends it as X-API-Key to this server only.",
    ),
  );
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const value = key.value.trim();
    if (!value) return;
    submit.disabled = true;
    error.textContent = "";
    try {
      await request("GET", "/v2/sandboxes", { query: { limit: 1 }, key: value });
      setKey(value, remember.checked);
      route();
    } catch (err) {
      error.textContent =
        err.status === 401 ? `Wrong API key: ${err.message}` : `Cannot log in: ${err.message}`;
      key.select();
    } finally {
      submit.disabled = false;
    }
  });
  replace(app, h("div", { class: "login-page" }, form));
  key.focus();
}

// Links inside the app are handled here, without a page load.
document.addEventListener("click", (e) => {
  const a = e.target.closest?.("a[data-link]");
  if (!a || e.ctrlKey || e.metaKey || e.shiftKey || e.button !== 0) return;
  const url = new URL(a.href);
  if (url.origin !== location.origin) return;
  e.preventDefault();
  if (url.pathname !== location.pathname) navigate(url.pathname + url.search);
});

window.addEventListener("popstate", route);
window.addEventListener("aenv:navigate", (e) => navigate(e.detail));
window.addEventListener("aenv:unauthorized", () => {
  if (!getKey()) return;
  clearKey();
  if (dispose) {
    dispose();
    dispose = null;
  }
  renderLogin("The API key was refused (revoked?): log in again.");
});

route();
