// The terminal panel: xterm.js (the pinned npm package, served under vendor/) on a
// PtySession. Without the package installed it says so instead of failing.

import { PtySession } from "./pty.js";
import { h, replace } from "./ui.js";

let xtermModules = null;

function loadXterm() {
  if (!xtermModules) {
    if (!document.querySelector("link[data-xterm]")) {
      document.head.append(h("link", { rel: "stylesheet", href: "vendor/xterm.css", "data-xterm": "" }));
    }
    xtermModules = Promise.all([import("../vendor/xterm.mjs"), import("../vendor/addon-fit.mjs")]).then(
      ([xterm, fit]) => ({ Terminal: xterm.Terminal, FitAddon: fit.FitAddon }),
    );
    xtermModules.catch(() => {
      xtermModules = null;
    });
  }
  return xtermModules;
}

const THEME = {
  background: "#0f1419",
  foreground: "#e6e1cf",
  cursor: "#f29718",
  selectionBackground: "#33415e",
};

export class TerminalPanel {
  // getToken(): the sandbox's envd access token (fresh: it is read at every attach).
  constructor(host, { sandboxId, getToken, user }) {
    this.host = host;
    this.sandboxId = sandboxId;
    this.getToken = getToken;
    this.user = user || "";
    this.term = null;
    this.session = null;
    this.status = h("span", { class: "term-status", id: "terminal-status" }, "");
    this.screen = h("div", { class: "term-screen", id: "terminal" });
    this.reconnectButton = h(
      "button",
      { class: "btn btn-small", hidden: true, onclick: () => this.reattach() },
      "Reconnect",
    );
    this.closeButton = h("button", { class: "btn btn-small", onclick: () => this.dispose() }, "Close");
    this.observer = null;
    this.onClose = null;
  }

  setStatus(text, kind = "") {
    this.status.textContent = text;
    this.status.className = `term-status ${kind}`;
    this.status.dataset.state = kind;
  }

  async open() {
    replace(
      this.host,
      h("div", { class: "term-bar" }, this.status, h("div", { class: "spacer" }), this.reconnectButton, this.closeButton),
      this.screen,
    );
    this.setStatus("Loading the terminal…");
    let mods;
    try {
      mods = await loadXterm();
    } catch {
      this.setStatus("", "error");
      replace(
        this.screen,
        h(
          "div",
          { class: "term-missing", id: "terminal-missing" },
          h("strong", {}, "The terminal's front-end package is not installed. "),
          "Run ",
          h("code", {}, "make install"),
          " on the server (it installs the pinned xterm.js into src/aenv/console/node_modules), then reload.",
        ),
      );
      return;
    }
    this.term = new mods.Terminal({
      cursorBlink: true,
      fontFamily: '"DejaVu Sans Mono", "Liberation Mono", monospace',
      fontSize: 13,
      scrollback: 5000,
      theme: THEME,
    });
    this.fit = new mods.FitAddon();
    this.term.loadAddon(this.fit);
    this.term.open(this.screen);
    this.fit.fit();
    this.term.onData((data) => this.session?.input(data));
    this.term.onResize(({ cols, rows }) => this.session?.resize(cols, rows).catch(() => {}));
    this.observer = new ResizeObserver(() => this.fit?.fit());
    this.observer.observe(this.screen);
    // For scripts and tests: the text on the terminal's screen.
    window.aenvTerminal = { text: () => this.text(), panel: this };
    await this.startShell();
  }

  makeSession(token) {
    return new PtySession({
      sandboxId: this.sandboxId,
      accessToken: token,
      user: this.user,
      onData: (bytes) => this.term?.write(bytes),
      onExit: (end) => {
        const why = end.error || end.status || `exit code ${end.exitCode}`;
        this.term?.write(`\r\n\x1b[2m[the shell ended: ${why}]\x1b[0m\r\n`);
        this.setStatus(`Shell ended (${why})`, "ended");
        this.reconnectButton.textContent = "New shell";
        this.reconnectButton.hidden = false;
      },
      onDetach: (reason) => {
        this.setStatus(`Disconnected: ${reason}`, "detached");
        this.reconnectButton.textContent = "Reconnect";
        this.reconnectButton.hidden = false;
      },
      onError: (err) => this.setStatus(`Input not delivered: ${err.message}`, "detached"),
    });
  }

  async startShell() {
    this.setStatus("Connecting…");
    this.reconnectButton.hidden = true;
    try {
      this.session = this.makeSession(await this.getToken());
      const pid = await this.session.start(this.term.cols, this.term.rows);
      this.setStatus(`Connected · bash (pid ${pid})${this.user ? ` as ${this.user}` : ""}`, "connected");
      this.term.focus();
    } catch (err) {
      this.setStatus(`Cannot start a shell: ${err.message}`, "error");
      this.reconnectButton.textContent = "Retry";
      this.reconnectButton.hidden = false;
    }
  }

  get detached() {
    return Boolean(this.term && this.session && !this.session.attached && !this.session.exited);
  }

  // After a pause and resume: the same shell if it is still there, else a new one.
  async reattach() {
    const old = this.session;
    if (!this.term) return;
    if (!old || old.exited || old.pid === null) {
      await this.startShell();
      return;
    }
    this.setStatus("Reconnecting…");
    this.reconnectButton.hidden = true;
    try {
      old.accessToken = await this.getToken();
      await old.reattach();
      await old.resize(this.term.cols, this.term.rows).catch(() => {});
      this.setStatus(`Connected · bash (pid ${old.pid})`, "connected");
      // A fresh prompt shows the shell is back.
      old.input("\r");
    } catch {
      this.term.write("\r\n\x1b[2m[the shell is gone: a new one]\x1b[0m\r\n");
      await this.startShell();
    }
  }

  text() {
    const buffer = this.term?.buffer.active;
    if (!buffer) return "";
    const lines = [];
    for (let i = 0; i < buffer.length; i += 1) lines.push(buffer.getLine(i)?.translateToString(true) ?? "");
    return lines.join("\n");
  }

  dispose() {
    this.observer?.disconnect();
    this.session?.close();
    this.session = null;
    this.term?.dispose();
    this.term = null;
    if (window.aenvTerminal?.panel === this) delete window.aenvTerminal;
    this.host.replaceChildren();
    this.onClose?.();
  }
}
