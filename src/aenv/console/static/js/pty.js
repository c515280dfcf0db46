// A shell on a PTY in a sandbox, spoken straight to the sandbox's envd with Connect-RPC
// (JSON codec) through the server's data plane on this same origin: the routing headers
// E2b-Sandbox-Id / E2b-Sandbox-Port name the sandbox and envd's port, X-Access-Token is
// the sandbox's envd token (from GET /sandboxes/{id}). The API key is never sent here:
// these requests are forwarded into the sandbox.
//
// process.Process/Start (and /Connect, to re-attach) is a server stream: the request is
// one envelope (flag byte, 4-byte big-endian length, JSON), the answer a run of them, the
// last flagged 0x02 (end of stream, maybe with an error). Input, resize and kill are unary
// calls with plain JSON bodies.

import { apiBase, errorOf } from "./api.js";

export const ENVD_PORT = 49983;
const END_STREAM = 0x02;

function envelope(message) {
  const json = new TextEncoder().encode(JSON.stringify(message));
  const out = new Uint8Array(5 + json.length);
  new DataView(out.buffer).setUint32(1, json.length);
  out.set(json, 5);
  return out;
}

// Whole envelopes from bytes as they arrive, split anywhere.
class EnvelopeReader {
  constructor() {
    this.buf = new Uint8Array(0);
    this.decoder = new TextDecoder();
  }

  feed(chunk) {
    const joined = new Uint8Array(this.buf.length + chunk.length);
    joined.set(this.buf);
    joined.set(chunk, this.buf.length);
    this.buf = joined;
    const out = [];
    while (this.buf.length >= 5) {
      const view = new DataView(this.buf.buffer, this.buf.byteOffset, this.buf.length);
      const flags = view.getUint8(0);
      const length = view.getUint32(1);
      if (this.buf.length < 5 + length) break;
      const text = this.decoder.decode(this.buf.subarray(5, 5 + length));
      out.push({ flags, message: text ? JSON.parse(text) : {} });
      this.buf = this.buf.slice(5 + length);
    }
    return out;
  }
}

export function b64encode(bytes) {
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  }
  return btoa(s);
}

export function b64decode(text) {
  const s = atob(text.replace(/-/g, "+").replace(/_/g, "/"));
  const out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i += 1) out[i] = s.charCodeAt(i);
  return out;
}

export class PtySession {
  // onData(Uint8Array), onExit({exitCode, status, error}), onDetach(reason): the stream
  // ended without the process ending (pause, network), re-attach with reattach().
  // onError(err): a call of input failed.
  constructor({ sandboxId, accessToken, user, onData, onExit, onDetach, onError }) {
    this.sandboxId = sandboxId;
    this.accessToken = accessToken;
    this.user = user;
    this.onData = onData;
    this.onExit = onExit;
    this.onDetach = onDetach;
    this.onError = onError;
    this.pid = null;
    this.exited = false;
    this.attached = false;
    this.pending = [];
    this.sending = false;
    this.controller = null;
  }

  headers(stream) {
    const headers = {
      "E2b-Sandbox-Id": this.sandboxId,
      "E2b-Sandbox-Port": String(ENVD_PORT),
      "Connect-Protocol-Version": "1",
      "Content-Type": stream ? "application/connect+json" : "application/json",
    };
    if (this.accessToken) headers["X-Access-Token"] = this.accessToken;
    if (this.user) headers.Authorization = `Basic ${btoa(`${this.user}:`)}`;
    if (stream) headers["Keepalive-Ping-Interval"] = "30";
    return headers;
  }

  // Starts `bash -i -l` on a PTY of cols x rows; resolves once envd reports its pid.
  start(cols, rows) {
    return this.stream("process.Process/Start", {
      process: {
        cmd: "/bin/bash",
        args: ["-i", "-l"],
        envs: { TERM: "xterm-256color", LANG: "C.UTF-8", LC_ALL: "C.UTF-8", COLORTERM: "truecolor" },
      },
      pty: { size: { cols, rows } },
    });
  }

  // Re-attaches to the shell after the stream was cut (the sandbox was paused and resumed).
  reattach() {
    return this.stream("process.Process/Connect", { process: { pid: this.pid } });
  }

  async stream(method, message) {
    this.controller?.abort();
    const controller = new AbortController();
    this.controller = controller;
    const resp = await fetch(`${apiBase}/${method}`, {
      method: "POST",
      headers: this.headers(true),
      body: envelope(message),
      signal: controller.signal,
      cache: "no-store",
    });
    if (!resp.ok) throw await errorOf(resp);
    const reader = resp.body.getReader();
    const decoder = new EnvelopeReader();
    let started;
    const first = new Promise((resolve, reject) => {
      started = { resolve, reject };
    });
    const pump = async () => {
      let reason = "the connection to the sandbox was closed";
      try {
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          for (const { flags, message: msg } of decoder.feed(value)) {
            if (flags & END_STREAM) {
              if (msg.error) reason = `${msg.error.code}: ${msg.error.message || ""}`;
              throw new Error(reason);
            }
            this.event(msg.event, started);
            if (reattaching) started.resolve(this.pid);
          }
        }
        throw new Error(reason);
      } catch (err) {
        if (controller.signal.aborted && this.controller !== controller) return;
        const wasAttached = this.attached;
        this.attached = false;
        started.reject(err);
        if (wasAttached && !this.exited) this.onDetach?.(err.message || reason);
      }
    };
    // Connect (re-attach) sends no start event: attached at its first message, or when
    // no error came within a moment (an idle shell says nothing).
    const reattaching = method.endsWith("/Connect");
    if (reattaching) {
      setTimeout(() => started.resolve(this.pid), 1500);
      first.then(() => {
        this.attached = true;
      }, () => {});
    }
    pump();
    return first;
  }

  event(ev, started) {
    if (!ev) return;
    if (ev.start) {
      this.pid = ev.start.pid;
      this.attached = true;
      started.resolve(this.pid);
    } else if (ev.data) {
      const chunk = ev.data.pty || ev.data.stdout || ev.data.stderr;
      if (chunk) this.onData(b64decode(chunk));
    } else if (ev.end) {
      this.exited = true;
      this.attached = false;
      this.onExit?.({
        exitCode: ev.end.exitCode ?? ev.end.exit_code ?? 0,
        status: ev.end.status || "",
        error: ev.end.error || "",
      });
    }
  }

  async unary(method, message) {
    const resp = await fetch(`${apiBase}/${method}`, {
      method: "POST",
      headers: this.headers(false),
      body: JSON.stringify(message),
      cache: "no-store",
    });
    if (!resp.ok) throw await errorOf(resp);
    return resp.json().catch(() => ({}));
  }

  // Keystrokes, in order: what is typed while a call is in flight goes in the next one.
  input(text) {
    if (this.pid === null || this.exited) return;
    this.pending.push(new TextEncoder().encode(text));
    if (!this.sending) this.flush().catch((err) => this.onError?.(err));
  }

  async flush() {
    this.sending = true;
    try {
      while (this.pending.length) {
        const parts = this.pending.splice(0);
        const size = parts.reduce((n, p) => n + p.length, 0);
        const bytes = new Uint8Array(size);
        let at = 0;
        for (const p of parts) {
          bytes.set(p, at);
          at += p.length;
        }
        await this.unary("process.Process/SendInput", {
          process: { pid: this.pid },
          input: { pty: b64encode(bytes) },
        });
      }
    } finally {
      this.sending = false;
    }
  }

  resize(cols, rows) {
    if (this.pid === null || this.exited) return Promise.resolve();
    return this.unary("process.Process/Update", {
      process: { pid: this.pid },
      pty: { size: { cols, rows } },
    });
  }

  // Ends the shell (an interactive bash ignores SIGTERM) and the stream.
  async close() {
    const pid = this.pid;
    const alive = pid !== null && !this.exited;
    this.exited = true;
    this.controller?.abort();
    this.controller = null;
    if (alive) {
      await this.unary("process.Process/SendSignal", {
        process: { pid },
        signal: "SIGNAL_SIGKILL",
      }).catch(() => {});
    }
  }
}
