// The public HTTP API, called with the user's key (X-API-Key). Nothing else is sent: the
// console has no privileges of its own.

const KEY_NAME = "aenv.apiKey";

// The API's root on this origin ("" unless a reverse proxy serves the console under a prefix).
export const apiBase = document.querySelector('meta[name="aenv-api"]')?.content || "";

export function getKey() {
  return sessionStorage.getItem(KEY_NAME) || localStorage.getItem(KEY_NAME) || "";
}

export function setKey(key, remember) {
  clearKey();
  (remember ? localStorage : sessionStorage).setItem(KEY_NAME, key);
}

export function clearKey() {
  sessionStorage.removeItem(KEY_NAME);
  localStorage.removeItem(KEY_NAME);
}

// An answer other than 2xx: E2B's {code, message} body when the server sent one.
export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function apiUrl(path, query) {
  const url = new URL(apiBase + path, location.origin);
  for (const [name, value] of Object.entries(query || {})) {
    if (value === undefined || value === null || value === "") continue;
    url.searchParams.set(name, String(value));
  }
  return url;
}

async function errorOf(resp) {
  const text = await resp.text().catch(() => "");
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  const message =
    (data && typeof data === "object" && (data.message || data.error?.message)) ||
    text.slice(0, 200) ||
    `${resp.status} ${resp.statusText}`;
  return new ApiError(resp.status, data?.code ?? resp.status, message);
}

// One API call; resolves to {data, headers, status}, rejects with an ApiError. `key`
// overrides the stored key (the login form checks a key before keeping it).
export async function request(method, path, { body, query, key } = {}) {
  const headers = { "X-API-Key": key ?? getKey(), Accept: "application/json" };
  const init = { method, headers, cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let resp;
  try {
    resp = await fetch(apiUrl(path, query), init);
  } catch (err) {
    throw new ApiError(0, 0, `cannot reach the server (${err.message})`);
  }
  if (!resp.ok) {
    const err = await errorOf(resp);
    if (resp.status === 401 && key === undefined) {
      window.dispatchEvent(new CustomEvent("aenv:unauthorized", { detail: err }));
    }
    throw err;
  }
  const text = await resp.text();
  return { data: text ? JSON.parse(text) : null, headers: resp.headers, status: resp.status };
}

export const api = {
  get: (path, query) => request("GET", path, { query }).then((r) => r.data),
  post: (path, body) => request("POST", path, { body }).then((r) => r.data),
  del: (path) => request("DELETE", path).then((r) => r.data),
  // A text answer (a patch), not JSON.
  text: async (path, query) => {
    const resp = await fetch(apiUrl(path, query), { headers: { "X-API-Key": getKey() }, cache: "no-store" });
    if (!resp.ok) throw await errorOf(resp);
    return resp.text();
  },
  // A page of a listing and the token of the next one (x-next-token), if any.
  page: async (path, query) => {
    const r = await request("GET", path, { query });
    return { items: r.data || [], next: r.headers.get("x-next-token") };
  },
};

export { errorOf };
