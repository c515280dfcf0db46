// DOM helpers, formatting, toasts and dialogs. No framework: pages build elements with h().

// h("div", {class: "x", onclick: fn}, child, ...): children may be strings, nodes, arrays,
// null or false (skipped).
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      el.addEventListener(name.slice(2), value);
    } else if (name === "dataset") {
      Object.assign(el.dataset, value);
    } else if (value === true) {
      el.setAttribute(name, "");
    } else {
      el.setAttribute(name, String(value));
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else el.append(child instanceof Node ? child : String(child));
  }
}

export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

// -- formatting ------------------------------------------------------------------------

export function fmtBytes(n) {
  if (n === undefined || n === null || Number.isNaN(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = Number(n);
  while (Math.abs(v) >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${v >= 100 || i === 0 ? v.toFixed(0) : v.toFixed(1)} ${units[i]}`;
}

export function fmtDuration(seconds) {
  const s = Math.max(0, Math.floor(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export function age(iso) {
  if (!iso) return "–";
  return fmtDuration((Date.now() - Date.parse(iso)) / 1000);
}

export function until(iso) {
  if (!iso) return "–";
  const left = (Date.parse(iso) - Date.now()) / 1000;
  return left <= 0 ? "now" : `in ${fmtDuration(left)}`;
}

export function fmtTime(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? String(iso) : d.toLocaleString();
}

export function pct(value) {
  if (value === undefined || value === null || Number.isNaN(value)) return "–";
  return `${Number(value).toFixed(value < 10 ? 1 : 0)}%`;
}

// A small horizontal gauge (0-100).
// `neutral`: a share that may exceed what is there (vCPUs handed out) is not a warning.
export function bar(percent, label, neutral = false) {
  const p = Math.max(0, Math.min(100, Number(percent) || 0));
  const level = neutral ? "neutral" : p >= 90 ? "high" : p >= 70 ? "mid" : "low";
  return h(
    "span",
    { class: "gauge", title: label || `${p.toFixed(0)}%` },
    h("span", { class: `gauge-fill ${level}`, style: `width:${p}%` }),
    h("span", { class: "gauge-text" }, label ?? `${p.toFixed(0)}%`),
  );
}

export function badge(state) {
  return h("span", { class: `badge state-${state}`, "data-state": state }, state);
}

export function link(href, ...children) {
  return h("a", { href, "data-link": "" }, ...children);
}

// -- toasts ----------------------------------------------------------------------------

function toastHost() {
  let host = document.getElementById("toasts");
  if (!host) {
    host = h("div", { id: "toasts", role: "status", "aria-live": "polite" });
    document.body.append(host);
  }
  return host;
}

export function toast(message, kind = "info", ms = 6000) {
  const el = h(
    "div",
    { class: `toast toast-${kind}` },
    h("span", {}, message),
    h("button", { class: "toast-close", title: "Dismiss", onclick: () => el.remove() }, "×"),
  );
  toastHost().append(el);
  setTimeout(() => el.remove(), ms);
  return el;
}

// An API error as E2B shapes it: {code, message}.
export function toastError(err, what) {
  const code = err?.code ?? err?.status;
  const text = `${what ? `${what}: ` : ""}${code ? `${code} ` : ""}${err?.message || err}`;
  toast(text, "error", 10000);
}

// -- dialogs ---------------------------------------------------------------------------

// A modal with `fields` ([{name, label, type, value, options, min, max}]); resolves to the
// values entered, or null when cancelled.
export function dialog({ title, text, fields = [], confirm = "OK", danger = false }) {
  return new Promise((resolve) => {
    const inputs = {};
    const form = h("form", { class: "dialog", method: "dialog" });
    const close = (value) => {
      backdrop.remove();
      document.removeEventListener("keydown", onKey);
      resolve(value);
    };
    const onKey = (e) => {
      if (e.key === "Escape") close(null);
    };
    for (const f of fields) {
      let input;
      if (f.options) {
        input = h(
          "select",
          { name: f.name },
          f.options.map((o) =>
            h("option", { value: o.value, selected: o.value === f.value }, o.label ?? o.value),
          ),
        );
      } else {
        input = h("input", {
          name: f.name,
          type: f.type || "text",
          value: f.value ?? "",
          min: f.min,
          max: f.max,
          placeholder: f.placeholder,
        });
      }
      inputs[f.name] = input;
      form.append(h("label", { class: "field" }, h("span", {}, f.label), input));
    }
    form.prepend(h("h2", {}, title), text ? h("p", {}, text) : null);
    form.append(
      h(
        "div",
        { class: "dialog-buttons" },
        h("button", { type: "button", class: "btn", onclick: () => close(null) }, "Cancel"),
        h("button", { type: "submit", class: `btn ${danger ? "btn-danger" : "btn-primary"}` }, confirm),
      ),
    );
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      const values = {};
      for (const [name, input] of Object.entries(inputs)) values[name] = input.value;
      close(values);
    });
    const backdrop = h("div", { class: "backdrop", onclick: (e) => e.target === backdrop && close(null) }, form);
    document.body.append(backdrop);
    document.addEventListener("keydown", onKey);
    (form.querySelector("input, select") || form.querySelector(".btn-primary, .btn-danger"))?.focus();
  });
}

export async function confirmDialog(title, text, confirm = "Confirm", danger = true) {
  return (await dialog({ title, text, confirm, danger })) !== null;
}

// -- navigation and polling ------------------------------------------------------------

// Pages ask the shell (main.js) to go elsewhere.
export function go(path) {
  window.dispatchEvent(new CustomEvent("aenv:navigate", { detail: path }));
}

// Calls `fn` now and then every `ms` after each call settles, while the page is shown;
// returns the function that stops it.
export function poll(fn, ms) {
  let stopped = false;
  let timer = null;
  const tick = async () => {
    if (stopped) return;
    try {
      await fn();
    } catch (err) {
      console.warn("refresh failed", err);
    }
    if (!stopped) timer = setTimeout(tick, document.hidden ? ms * 5 : ms);
  };
  tick();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}

export function sandboxTemplate(s) {
  return s.alias || s.templateID || "–";
}
