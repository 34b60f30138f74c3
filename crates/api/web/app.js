// The Better Compute console: a client of the HTTP API (POST /v1/<method> with the signed-in
// token) that follows /v1/watch to stay current. It builds the page from DOM nodes and text, never
// from HTML strings, so nothing the API returns can inject markup.

const TOKEN_KEY = "better-compute-token";
const RERENDER_AFTER_MS = 250;
const WATCH_RETRY_MS = 3000;

const state = { token: sessionStorage.getItem(TOKEN_KEY), operator: false, watching: null, rendering: null, drafts: {} };

// ---- DOM helpers ---------------------------------------------------------------------------------

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

const SVG = "http://www.w3.org/2000/svg";
function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  for (const c of children) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}

function say(text, kind = "error") {
  const m = document.getElementById("message");
  m.className = kind === "info" ? "info" : "";
  m.textContent = text;
}

const GOOD = new Set(["connected", "active", "enabled", "closed", "ok", "placed", "succeeded", "healthy", "delivered", "running", "True"]);
const BAD = new Set(["unreachable", "lost", "revoked", "disabled", "open", "denied", "failed", "expired", "unhealthy", "dead", "cancelled", "disconnected"]);
function badge(text) {
  const t = String(text ?? "");
  const cls = GOOD.has(t) ? "ok" : BAD.has(t) ? "bad" : t === "" ? "" : "warn";
  return h("span", { class: `state ${cls}` }, t || "–");
}

function when(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  return isNaN(d) ? String(iso) : d.toLocaleString();
}

// A table of rows; each column is [heading, (row) => cell].
function table(caption, columns, rows) {
  if (!rows.length) return h("p", { class: "muted" }, `No ${caption.toLowerCase()}.`);
  return h("table", {},
    h("caption", {}, `${caption}: ${rows.length}`),
    h("thead", {}, h("tr", {}, columns.map(([name]) => h("th", { scope: "col" }, name)))),
    h("tbody", {}, rows.map((r) => h("tr", {}, columns.map(([, cell]) => {
      const v = cell(r);
      return h("td", {}, v instanceof Node ? v : String(v ?? "–"));
    })))));
}

// ---- The API -------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, body) {
    super(body?.error?.message || `HTTP ${status}`);
    this.status = status;
    this.code = body?.error?.code || "UNKNOWN";
  }
}

async function api(method, body = {}) {
  const r = await fetch(`/v1/${method}`, {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${state.token}` },
    body: JSON.stringify(body),
  });
  const json = await r.json().catch(() => ({}));
  if (!r.ok) {
    if (r.status === 401) signOut("Your token was refused (expired or revoked); sign in again.");
    throw new ApiError(r.status, json);
  }
  return json;
}

// Every item of a list method, following page tokens (bounded: a console page shows at most this).
const MAX_ITEMS = 2000;
async function all(method, body = {}) {
  const items = [];
  let pageToken;
  do {
    const page = await api(method, { ...body, pageSize: 500, ...(pageToken ? { pageToken } : {}) });
    items.push(...(page.items || []));
    pageToken = page.nextPageToken;
  } while (pageToken && items.length < MAX_ITEMS);
  return items;
}

// Runs a change from a button, reporting its outcome; the watch stream re-renders the page.
async function act(what, method, body) {
  try {
    await api(method, body);
    say(`${what}: done.`, "info");
    schedule();
  } catch (e) {
    say(`${what}: ${e.code}: ${e.message}`);
  }
}

function key() {
  return `console-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 10)}`;
}

// ---- Live: /v1/watch as Server-Sent Events over fetch (EventSource cannot send the token) -------------

async function watch() {
  const controller = new AbortController();
  state.watching = controller;
  const live = document.getElementById("live");
  let lastId = null;
  while (!controller.signal.aborted && state.token) {
    try {
      const headers = { Authorization: `Bearer ${state.token}` };
      if (lastId) headers["Last-Event-ID"] = lastId;
      const r = await fetch("/v1/watch", { headers, signal: controller.signal });
      if (!r.ok) throw new Error(`watch: HTTP ${r.status}`);
      live.textContent = "● live";
      const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let at;
        while ((at = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, at);
          buffer = buffer.slice(at + 2);
          const id = block.split("\n").find((l) => l.startsWith("id:"));
          if (id) lastId = id.slice(3).trim();
          if (block.split("\n").some((l) => l.startsWith("data:"))) schedule();
        }
      }
    } catch (e) {
      if (controller.signal.aborted) return;
    }
    live.textContent = "○ reconnecting…";
    await new Promise((r) => setTimeout(r, WATCH_RETRY_MS));
  }
}

// Events come in bursts: one re-render after the burst.
let pending = null;
function schedule() {
  clearTimeout(pending);
  pending = setTimeout(render, RERENDER_AFTER_MS);
}

// ---- Pages ---------------------------------------------------------------------------------------

const PAGES = [
  { id: "fleet", title: "Fleet", operator: true, render: fleetPage },
  { id: "reservations", title: "Reservations", render: reservationsPage },
  { id: "instances", title: "Instances", render: instancesPage },
  { id: "jobs", title: "Jobs", operator: true, render: jobsPage },
  { id: "workflows", title: "Workflows", operator: true, render: workflowsPage },
  { id: "webhooks", title: "Webhooks", render: webhooksPage },
  { id: "audit", title: "Audit", render: auditPage },
  { id: "account", title: "Account", render: accountPage },
];

function nodeColour(n) {
  if (n.liveness !== "connected") return "bad";
  if ((n.noScheduleReasons || []).length) return "warn";
  return "ok";
}

// GPUs per pool and model: how many, by health, quarantined, and by mode.
function gpuRows(pools, gpusByPool) {
  const rows = [];
  pools.forEach((p, i) => {
    const byModel = new Map();
    for (const g of gpusByPool[i]) {
      const r = byModel.get(g.model) || { pool: p.name, model: g.model, total: 0, healthy: 0, checking: 0, unhealthy: 0, quarantined: 0, modes: {} };
      r.total += 1;
      if (g.healthState === "healthy") r.healthy += 1; else if (g.healthState === "unhealthy") r.unhealthy += 1; else r.checking += 1;
      if (g.quarantined) r.quarantined += 1;
      r.modes[g.mode] = (r.modes[g.mode] || 0) + 1;
      byModel.set(g.model, r);
    }
    rows.push(...byModel.values());
  });
  return rows;
}

// Usage windows change slowly: the fleet page's per-day figures are fetched at most once a minute.
const USAGE_CACHE_MS = 60e3;
const DAYS = 14;
let usageCache = { at: 0, days: [] };

// Every tenant's atom-hours per pool and per atom class, for each of the last DAYS UTC days (two
// usage.list per day).
async function usagePerDay() {
  if (Date.now() - usageCache.at < USAGE_CACHE_MS) return usageCache.days;
  const today = new Date(new Date().toISOString().slice(0, 10) + "T00:00:00Z").getTime();
  const hoursBy = async (groupBy, from, to) => {
    const r = await api("usage.list", { allTenants: true, groupBy, from: from.toISOString(), to: to.toISOString() });
    return Object.fromEntries((r.items || []).map((u) => [u.group, u.atomSeconds / 3600]));
  };
  const days = await Promise.all([...Array(DAYS).keys()].reverse().map(async (back) => {
    const from = new Date(today - back * 86400e3), to = new Date(today - (back - 1) * 86400e3);
    const [byPool, byModel] = await Promise.all([hoursBy("pool", from, to), hoursBy("model", from, to)]);
    return { day: from.toISOString().slice(0, 10), byPool, byModel };
  }));
  usageCache = { at: Date.now(), days };
  return days;
}

// One row per series (a pool, an atom class): the share of its atoms booked each day (atom-hours
// over atoms × 24 h), as bars. `series`: [{ name, atoms, hours: (day) => atom-hours }].
function utilisationChart(what, series, days) {
  const W = 1000, rowH = 70, labelW = 170, top = 18;
  const w = (W - labelW - 10) / days.length;
  const svg = s("svg", { class: "timeline", viewBox: `0 0 ${W} ${top + rowH * series.length}`, role: "img",
    "aria-label": `The share of each ${what}'s atoms booked per day over the last ${days.length} days` });
  days.forEach((d, j) => { if (j % 2 === 0) svg.append(s("text", { x: labelW + j * w, y: 13 }, d.day.slice(5))); });
  series.forEach((x, i) => {
    const y = top + i * rowH;
    svg.append(s("rect", { class: "row", x: labelW, y, width: W - labelW - 10, height: rowH - 8 }));
    svg.append(s("text", { x: 4, y: y + 20 }, x.name));
    svg.append(s("text", { x: 4, y: y + 38 }, `${x.atoms} atoms`));
    days.forEach((d, j) => {
      const hours = x.hours(d);
      const share = x.atoms ? Math.min(1, hours / (x.atoms * 24)) : 0;
      const bh = share * (rowH - 12);
      const bar = s("rect", { class: "bar", x: labelW + j * w + 2, y: y + rowH - 10 - bh, width: Math.max(w - 4, 1), height: bh });
      bar.append(s("title", {}, `${x.name} ${d.day}: ${(share * 100).toFixed(1)}% booked (${hours.toFixed(1)} atom-hours)`));
      svg.append(bar);
    });
  });
  return svg;
}

// The atoms placement may use, per pool and per atom class (`kind/model[/profile]`, as usage names
// them).
function atomSeries(pools, gpusByPool) {
  const classes = new Map();
  const perPool = pools.map((p, i) => {
    let atoms = 0;
    for (const g of gpusByPool[i]) {
      for (const a of (g.atoms || []).filter((a) => a.active)) {
        atoms += 1;
        const c = [a.kind, g.model, a.profile].filter(Boolean).join("/");
        classes.set(c, (classes.get(c) || 0) + 1);
      }
    }
    return { name: p.name, atoms, hours: (d) => d.byPool[p.id] || 0 };
  });
  const perClass = [...classes].map(([c, atoms]) => ({ name: c, atoms, hours: (d) => d.byModel[c] || 0 }));
  return { perPool, perClass };
}

async function fleetPage() {
  const [nodes, pools] = await Promise.all([all("nodes.list"), all("pools.list")]);
  const gpusByPool = await Promise.all(pools.map((p) => all("devices.list", { poolId: p.id }).catch(() => [])));
  const days = await usagePerDay().catch(() => null);
  const { perPool, perClass } = atomSeries(pools, gpusByPool);
  const by = (f) => nodes.filter(f).length;
  const grid = h("div", { class: "grid", role: "list" }, nodes.map((n) => {
    const reasons = (n.noScheduleReasons || []).join(", ");
    const label = `${n.name}: ${n.liveness}${reasons ? `, not schedulable (${reasons})` : ""}`;
    return h("a", { role: "listitem", href: `#/node/${n.id}`, class: nodeColour(n), title: label, "aria-label": label },
      h("strong", {}, n.name), h("br"), n.liveness, reasons ? h("br") : null, reasons || null);
  }));
  return [
    h("h1", {}, "Fleet"),
    h("div", { class: "cards" },
      h("div", { class: "card" }, h("b", {}, nodes.length), "nodes"),
      h("div", { class: "card" }, h("b", {}, by((n) => n.liveness === "connected")), "connected"),
      h("div", { class: "card" }, h("b", {}, by((n) => (n.noScheduleReasons || []).length > 0)), "not schedulable"),
      h("div", { class: "card" }, h("b", {}, by((n) => n.liveness !== "connected")), "away"),
      h("div", { class: "card" }, h("b", {}, pools.length), "pools")),
    h("h2", {}, "Nodes by state"),
    h("p", { class: "legend" }, h("span", {}, badge("connected"), " schedulable"), h("span", {}, badge("cordoned"), " not schedulable"), h("span", {}, badge("unreachable"), " away")),
    grid,
    h("h2", {}, "GPUs by pool and model"),
    table("GPU classes", [["Pool", (r) => r.pool], ["Model", (r) => r.model], ["GPUs", (r) => r.total], ["Healthy", (r) => r.healthy],
                          ["Being checked", (r) => r.checking], ["Unhealthy", (r) => r.unhealthy], ["Quarantined", (r) => r.quarantined],
                          ["Modes", (r) => Object.entries(r.modes).map(([m, n]) => `${n} ${m}`).join(", ")]], gpuRows(pools, gpusByPool)),
    h("h2", {}, `Atoms booked per pool, last ${DAYS} days`),
    days ? utilisationChart("pool", perPool, days) : h("p", { class: "muted" }, "Usage is not visible to this token."),
    h("h2", {}, `Atoms booked per class, last ${DAYS} days`),
    days ? utilisationChart("atom class", perClass, days) : null,
    h("h2", {}, "Pools"),
    table("Pools", [["Name", (p) => p.name], ["Kind", (p) => p.kind], ["Nodes", (p) => nodes.filter((n) => n.poolId === p.id).length],
                    ["Connected", (p) => nodes.filter((n) => n.poolId === p.id && n.liveness === "connected").length],
                    ["Health circuit", (p) => (p.healthCircuitOpenSince ? badge("open") : badge("closed"))], ["Id", (p) => h("span", { class: "mono" }, p.id)]], pools),
  ];
}

// Each GPU a row; each reservation holding one of its atoms a bar, from an hour ago to a day ahead.
function timeline(gpus, reservations) {
  const now = Date.now();
  const from = now - 3600e3;
  const to = now + 24 * 3600e3;
  const W = 1000, labelW = 170, rowH = 26, top = 20;
  const x = (t) => labelW + ((Math.min(Math.max(t, from), to) - from) / (to - from)) * (W - labelW - 10);
  const svg = s("svg", { class: "timeline", viewBox: `0 0 ${W} ${top + rowH * gpus.length + 6}`, role: "img",
    "aria-label": `Bookings of ${gpus.length} GPUs from an hour ago to a day ahead; the red line is now` });
  for (const hour of [-1, 0, 6, 12, 18, 23]) {
    svg.append(s("text", { x: x(now + hour * 3600e3), y: 13 }, hour === 0 ? "now" : `${hour > 0 ? "+" : ""}${hour} h`));
  }
  gpus.forEach((g, i) => {
    const y = top + i * rowH;
    svg.append(s("rect", { class: "row", x: labelW, y, width: W - labelW - 10, height: rowH - 4 }));
    svg.append(s("text", { x: 4, y: y + 16 }, `${g.index}: ${g.model} (${g.mode})`));
    const atoms = new Set([g.id, ...(g.atoms || []).map((a) => a.id)]);
    for (const r of reservations) {
      if (!(r.atoms || []).some((a) => atoms.has(a))) continue;
      const x0 = x(Date.parse(r.startsAt)), x1 = x(Date.parse(r.endsAt));
      const bar = s("rect", { class: `bar ${r.state}`, x: x0, y: y + 2, width: Math.max(x1 - x0, 2), height: rowH - 8 });
      bar.append(s("title", {}, `${r.id} (${r.state}) ${when(r.startsAt)} → ${when(r.endsAt)}`));
      bar.setAttribute("data-reservation", r.id);
      svg.append(bar);
    }
  });
  svg.append(s("line", { class: "now", x1: x(now), x2: x(now), y1: top - 4, y2: top + rowH * gpus.length }));
  return svg;
}

async function nodePage(id) {
  const d = await api("nodes.describe", { nodeId: id });
  const n = d.node;
  const reason = () => prompt("Why? (operators and tenants see it)") || "";
  const buttons = h("div", { class: "actions" },
    h("button", { type: "button", onclick: () => act("Cordon", "nodes.cordon", { nodeId: id, reason: reason() || "console" }) }, "Cordon"),
    h("button", { type: "button", class: "secondary", onclick: () => act("Uncordon", "nodes.uncordon", { nodeId: id }) }, "Uncordon"),
    h("button", { type: "button", onclick: () => act("Drain", "nodes.drain", { nodeId: id, reason: reason() || "console" }) }, "Drain"),
    h("button", { type: "button", class: "secondary", onclick: () => act("Undrain", "nodes.undrain", { nodeId: id }) }, "Undrain"));
  return [
    h("h1", {}, `Node ${n.name} `, badge(n.liveness)),
    h("p", { class: "mono" }, n.id, " · pool ", n.poolId, " · generation ", n.observedGeneration, "/", n.generation,
      (n.noScheduleReasons || []).length ? ` · not schedulable: ${n.noScheduleReasons.join(", ")}` : ""),
    buttons,
    h("h2", {}, "Bookings per GPU"),
    timeline(d.gpus || [], d.reservations || []),
    h("h2", {}, "GPUs"),
    table("GPUs", [["Health", (g) => badge(g.healthState)], ["Index", (g) => g.index], ["Model", (g) => g.model], ["Mode", (g) => g.mode],
                   ["Quarantined", (g) => (g.quarantined ? `yes: ${g.quarantineReason || ""}` : "no")],
                   ["Quarantine", (g) => g.quarantined
                     ? h("button", { type: "button", class: "secondary", onclick: () => act("Release quarantine", "devices.releaseQuarantine", { deviceId: g.id }) }, "Release")
                     : h("button", { type: "button", class: "secondary", onclick: () => act("Quarantine", "devices.quarantine", { deviceId: g.id, reason: reason() || "console" }) }, "Quarantine")],
                   ["Id", (g) => h("span", { class: "mono" }, g.id)]], d.gpus || []),
    h("h2", {}, "Conditions"),
    table("Conditions that hold", [["Type", (c) => badge(c.type)], ["Reason", (c) => c.reason], ["Message", (c) => c.message], ["Since", (c) => when(c.since)]], n.conditions || []),
    h("h2", {}, "Reservations now and next"),
    table("Reservations", [["State", (r) => badge(r.state)], ["Id", (r) => h("span", { class: "mono" }, r.id)], ["Tenant", (r) => r.tenantId], ["Atoms", (r) => (r.atoms || []).length],
                           ["Starts", (r) => when(r.startsAt)], ["Ends", (r) => when(r.endsAt)]], d.reservations || []),
    h("h2", {}, "Session"),
    d.session
      ? table("Sessions", [["State", (x) => badge(x.closedAt ? "disconnected" : "connected")], ["Gateway", (x) => x.gatewayId], ["Epoch", (x) => x.epoch], ["Opened", (x) => when(x.openedAt)],
                           ["Last seen", (x) => when(x.lastSeenAt)], ["Daemon", (x) => x.daemonVersion], ["Boot", (x) => h("span", { class: "mono" }, x.bootId)], ["Closed because", (x) => x.closeReason || ""]], [d.session])
      : h("p", { class: "muted" }, "No session yet."),
    h("h2", {}, "Commands"),
    table("Commands", [["State", (c) => badge(c.state)], ["Kind", (c) => c.kind], ["Seq", (c) => c.seq], ["Reason", (c) => c.reason], ["Id", (c) => h("span", { class: "mono" }, c.id)]], d.recentCommands || []),
    h("h2", {}, "Events"),
    table("Events", [["Type", (e) => e.type], ["Subject", (e) => h("span", { class: "mono" }, e.subject)], ["Time", (e) => when(e.time)]], d.recentEvents || []),
  ];
}

async function reservationsPage() {
  const [reservations, pools] = await Promise.all([all("reservations.list"), all("pools.list").catch(() => [])]);
  const poolInput = pools.length
    ? h("select", { name: "poolId", id: "f-pool" }, pools.map((p) => h("option", { value: p.id }, `${p.name} (${p.kind})`)))
    : h("input", { name: "poolId", id: "f-pool", required: true, placeholder: "pool_…" });
  // Reserves what the form says (from `extra.startsAt` when given, else now).
  const reserve = async (extra = {}) => {
    const f = new FormData(form);
    const body = { poolId: f.get("poolId"), gpu: { kind: "gpu", model: f.get("model"), count: Number(f.get("count")) },
      vcpu: Number(f.get("vcpu")), memoryMib: Number(f.get("memoryGib")) * 1024, durationS: Number(f.get("hours")) * 3600, idempotencyKey: key(), ...extra };
    try {
      const r = await api("reservations.create", body);
      delete state.drafts.reservations;
      say(r.state === "pending"
        ? `Reservation ${r.id} is pending: ${(r.conditions?.[0]?.message) || "no room yet"}`
        : `Reservation ${r.id} is ${r.state} on ${r.nodeId}.`, r.state === "pending" ? "error" : "info");
      schedule();
    } catch (err) {
      say(`New reservation: ${err.code}: ${err.message}`);
    }
  };
  const form = h("form", { class: "inline", "aria-label": "New reservation", onsubmit: (e) => { e.preventDefault(); reserve(); } },
    h("label", { for: "f-pool" }, "Pool", poolInput),
    h("label", {}, "GPU model", h("input", { name: "model", value: "H100-80GB", required: true })),
    h("label", {}, "GPUs", h("input", { name: "count", type: "number", min: 0, max: 64, value: 1, required: true })),
    h("label", {}, "vCPU", h("input", { name: "vcpu", type: "number", min: 1, value: 8, required: true })),
    h("label", {}, "Memory (GiB)", h("input", { name: "memoryGib", type: "number", min: 1, value: 64, required: true })),
    h("label", {}, "Hours", h("input", { name: "hours", type: "number", min: 1, max: 8784, value: 1, required: true })),
    h("button", { type: "submit" }, "Reserve"));
  // What fits and when, as the form changes (reservations.availability: advice, nothing booked).
  const fits = h("p", { id: "f-fits", role: "status", "aria-live": "polite", class: "muted" });
  let checking = null;
  const check = () => {
    clearTimeout(checking);
    checking = setTimeout(async () => {
      const f = new FormData(form);
      const gpu = { kind: "gpu", model: f.get("model"), count: Number(f.get("count")) };
      const durationS = Number(f.get("hours")) * 3600;
      try {
        const a = await api("reservations.availability", { poolId: f.get("poolId"), gpu, durationS });
        if (a.fitsNow) {
          fits.replaceChildren(`Fits now: a node has ${a.mostFreeOnOneNodeNow} of the pool's ${a.placeableAtoms} placeable ${gpu.model} free for the whole time.`);
        } else if (a.earliestStart) {
          fits.replaceChildren(`Does not fit now (the most one node has free is ${a.mostFreeOnOneNodeNow}); it fits from ${when(a.earliestStart)}. `,
            h("button", { type: "button", class: "secondary", onclick: () => reserve({ startsAt: a.earliestStart }) }, "Reserve from then"));
        } else {
          fits.replaceChildren(`Does not fit within 30 days: no node has ${gpu.count} placeable ${gpu.model} free for that long (${a.placeableAtoms} in the pool).`);
        }
      } catch (e) {
        fits.replaceChildren(`${e.code}: ${e.message}`);
      }
    }, RERENDER_AFTER_MS);
  };
  form.addEventListener("input", check);
  setTimeout(check, 0);
  const ended = new Set(["released", "expired", "failed"]);
  return [
    h("h1", {}, "Reservations"),
    h("h2", {}, "New reservation"),
    form,
    fits,
    h("h2", {}, "Yours"),
    table("Reservations", [
      ["State", (r) => badge(r.state)], ["Id", (r) => h("span", { class: "mono" }, r.id)],
      ["GPUs", (r) => `${r.gpu.count} × ${r.gpu.model}${r.gpu.profile ? ` ${r.gpu.profile}` : ""}`],
      ["Node", (r) => (r.nodeId ? (state.operator ? h("a", { href: `#/node/${r.nodeId}` }, r.nodeId) : r.nodeId) : "–")],
      ["Starts", (r) => when(r.startsAt)], ["Ends", (r) => when(r.endsAt)],
      ["Why pending", (r) => r.conditions?.[0]?.message || ""],
      ["", (r) => ended.has(r.state) ? "" : h("div", { class: "actions" },
        h("button", { type: "button", class: "secondary", "aria-label": `Extend ${r.id} by an hour`,
          onclick: () => act("Extend", "reservations.extend", { reservationId: r.id, endsAt: new Date(Date.parse(r.endsAt) + 3600e3).toISOString(), idempotencyKey: key() }) }, "+1 h"),
        h("button", { type: "button", "aria-label": `Release ${r.id}`, onclick: () => act("Release", "reservations.release", { reservationId: r.id }) }, "Release"))],
    ], reservations),
  ];
}

async function instancesPage() {
  const [items, pools, images] = await Promise.all([all("instances.list"), all("pools.list").catch(() => []), api("vpsImages.list").then((r) => r.items || [], () => [])]);
  const vpsPools = pools.filter((p) => p.kind === "vps-host");
  const form = h("form", { class: "inline", "aria-label": "New instance", onsubmit: async (e) => {
    e.preventDefault();
    const f = new FormData(e.target);
    const body = { poolId: f.get("poolId"), image: f.get("image"), gpu: { kind: "gpu", model: f.get("model"), count: Number(f.get("count")) },
      vcpu: Number(f.get("vcpu")), memoryMib: Number(f.get("memoryGib")) * 1024, diskGib: Number(f.get("diskGib")), durationS: Number(f.get("hours")) * 3600,
      sshPublicKeys: [String(f.get("sshKey")).trim()], idempotencyKey: key() };
    try {
      const i = await api("instances.create", body);
      delete state.drafts.instances;
      say(`Instance ${i.id} is ${i.state}; once running, connect with ssh debian@<address> (its host key fingerprint is listed below).`, "info");
      schedule();
    } catch (err) {
      say(`New instance: ${err.code}: ${err.message}`);
    }
  } },
    h("label", {}, "Pool", vpsPools.length
      ? h("select", { name: "poolId" }, vpsPools.map((p) => h("option", { value: p.id }, p.name)))
      : h("input", { name: "poolId", required: true, placeholder: "pool_… (a vps-host pool)" })),
    h("label", {}, "Image", images.length
      ? h("select", { name: "image" }, images.map((i) => h("option", { value: i.name }, i.name)))
      : h("input", { name: "image", required: true, value: "debian-12" })),
    h("label", {}, "GPU model", h("input", { name: "model", value: "H100-80GB", required: true })),
    h("label", {}, "GPUs", h("input", { name: "count", type: "number", min: 0, max: 8, value: 1, required: true })),
    h("label", {}, "vCPU", h("input", { name: "vcpu", type: "number", min: 1, value: 4, required: true })),
    h("label", {}, "Memory (GiB)", h("input", { name: "memoryGib", type: "number", min: 1, value: 8, required: true })),
    h("label", {}, "Disk (GiB)", h("input", { name: "diskGib", type: "number", min: 1, value: 20, required: true })),
    h("label", {}, "Hours", h("input", { name: "hours", type: "number", min: 1, value: 1, required: true })),
    h("label", {}, "SSH public key", h("input", { name: "sshKey", required: true, placeholder: "ssh-ed25519 AAAA… you@laptop", size: 40 })),
    h("button", { type: "submit" }, "Create"));
  const live = new Set(["requested", "provisioning", "running", "stopping", "stopped"]);
  return [h("h1", {}, "Instances"),
    h("h2", {}, "New instance"),
    form,
    h("h2", {}, "Yours"),
    table("Instances", [["State", (i) => badge(i.state)], ["Id", (i) => h("span", { class: "mono" }, i.id)], ["Image", (i) => i.image],
                        ["Address", (i) => i.address || "–"], ["Connect", (i) => (i.address ? h("span", { class: "mono" }, `ssh debian@${i.address}`) : "–")],
                        ["Host key", (i) => h("span", { class: "mono" }, i.hostKeyFingerprint || "–")], ["Why", (i) => i.reason || ""],
                        ["", (i) => !live.has(i.state) ? "" : h("div", { class: "actions" },
                          ["reboot", "stop", "start", "delete"].map((verb) => h("button", { type: "button", class: verb === "delete" ? "" : "secondary", "aria-label": `${verb} ${i.id}`,
                            onclick: () => act(`${verb[0].toUpperCase()}${verb.slice(1)} ${i.id}`, `instances.${verb}`, { instanceId: i.id }) }, verb)))]], items)];
}

async function jobsPage() {
  const j = await api("jobs.list");
  const backlog = j.queues.reduce((n, q) => n + q.due, 0);
  const failing = j.queues.reduce((n, q) => n + q.failing, 0);
  return [h("h1", {}, "Jobs"),
    h("div", { class: "cards" },
      h("div", { class: "card" }, h("b", {}, j.queues.length), "jobs"),
      h("div", { class: "card" }, h("b", {}, backlog), "keys due"),
      h("div", { class: "card" }, h("b", {}, failing), "keys failing"),
      h("div", { class: "card" }, h("b", {}, j.holders.filter((w) => w.live).length), "live workers")),
    h("h2", {}, "Queues"),
    table("Queues", [["Job", (q) => q.job], ["Depth", (q) => q.depth], ["Due", (q) => q.due], ["Claimed", (q) => q.claimed],
                     ["Failing", (q) => (q.failing ? badge(String(q.failing)) : 0)], ["Oldest due", (q) => (q.oldestDueS == null ? "–" : `${q.oldestDueS.toFixed(1)} s (${q.oldestDueKey})`)],
                     ["Newest error", (q) => q.lastError || ""]], j.queues),
    h("h2", {}, "Who holds what"),
    table("Workers", [["Live", (w) => badge(w.live ? "connected" : "lost")], ["Worker", (w) => h("span", { class: "mono" }, w.workerId)], ["Shards", (w) => w.shards.length],
                      ["Singletons", (w) => w.singletons.join(", ")], ["Checks", (w) => (w.checks || []).map((c) => `${c.name}: ${c.ok ? "ok" : c.detail}`).join("; ")]], j.holders)];
}

async function workflowsPage() {
  const items = await all("workflows.list");
  return [h("h1", {}, "Workflows"),
    table("Workflows", [["State", (w) => badge(w.state)], ["Definition", (w) => w.definition], ["Target", (w) => JSON.stringify(w.target)],
                        ["Step", (w) => w.currentStep ?? "–"], ["Started", (w) => when(w.createdAt)], ["Id", (w) => h("span", { class: "mono" }, w.id)]], items)];
}

async function webhooksPage() {
  const hooks = await all("webhooks.list");
  const dead = await all("webhooks.deadLetters.list");
  return [h("h1", {}, "Webhooks"),
    table("Webhooks", [["State", (w) => badge(w.enabled ? "enabled" : "disabled")], ["URL", (w) => h("span", { class: "mono" }, w.url)], ["Types", (w) => (w.eventTypes || []).join(", ") || "all"],
                       ["Why disabled", (w) => w.disabledReason || ""],
                       ["Id", (w) => h("span", { class: "mono" }, w.id)]], hooks),
    h("h2", {}, "Dead letters"),
    table("Dead letters", [["State", (d) => badge(d.state)], ["Webhook", (d) => h("span", { class: "mono" }, d.webhookId)], ["Event", (d) => d.eventType], ["Attempts", (d) => d.attempts],
                           ["Last error", (d) => d.lastError || (d.lastStatus ? `HTTP ${d.lastStatus}` : "")],
                           ["", (d) => h("button", { type: "button", class: "secondary", onclick: () => act("Replay", "webhooks.deadLetters.replay", { deliveryId: d.id }) }, "Replay")]], dead)];
}

async function auditPage() {
  // Oldest first from a day ago; the newest hundred shown first.
  const entries = (await all("audit.list", { from: new Date(Date.now() - 86400e3).toISOString() })).slice(-100).reverse();
  return [h("h1", {}, "Audit: who did what"),
    table("Entries of the last day (newest 100)", [["Outcome", (a) => badge(a.outcome)], ["Time", (a) => when(a.at)], ["Actor", (a) => a.actorId || a.actorKind], ["Action", (a) => a.action],
                                   ["Target", (a) => h("span", { class: "mono" }, a.target)], ["Request", (a) => h("span", { class: "mono" }, a.requestId || "–")]], entries)];
}

// Atom-hours per UTC day as bars, with each day's figure in the bar's title and in a table.
function usageChart(days) {
  const W = 1000, H = 160, pad = 24;
  const most = Math.max(1, ...days.map((d) => d.atomSeconds / 3600));
  const w = (W - pad) / Math.max(days.length, 1);
  const svg = s("svg", { class: "timeline", viewBox: `0 0 ${W} ${H + 20}`, role: "img", "aria-label": `Atom-hours per day over ${days.length} days` });
  days.forEach((d, i) => {
    const hours = d.atomSeconds / 3600;
    const bh = (hours / most) * (H - pad);
    const bar = s("rect", { class: "bar", x: pad + i * w + 2, y: H - bh, width: Math.max(w - 4, 1), height: bh });
    bar.append(s("title", {}, `${d.group}: ${hours.toFixed(1)} atom-hours`));
    svg.append(bar);
    svg.append(s("text", { x: pad + i * w + 2, y: H + 14 }, String(d.group).slice(5, 10)));
  });
  return svg;
}

async function accountPage() {
  const since = new Date(Date.now() - 14 * 86400e3).toISOString();
  const [quota, tokens, identities, usage] = await Promise.all([api("quotas.get").catch(() => null), all("tokens.list").catch(() => []), all("identities.list").catch(() => []),
    api("usage.list", { groupBy: "day", from: since, to: new Date(Date.now() + 86400e3).toISOString() }).catch(() => null)]);
  return [h("h1", {}, "Quota, usage, identities and tokens"),
    h("h2", {}, "Quota"),
    quota ? table("Quota", [["Resource", (q) => q.resource], ["Used", (q) => q.used], ["Limit", (q) => q.max]], quota.items || []) : h("p", { class: "muted" }, "Not visible to this token."),
    h("h2", {}, "Usage by day (last 14 days)"),
    usage && usage.items?.length ? usageChart(usage.items) : h("p", { class: "muted" }, "No usage metered yet."),
    usage ? table("Days", [["Day", (d) => d.group], ["Atom-hours", (d) => (d.atomSeconds / 3600).toFixed(2)], ["vCPU-hours", (d) => (d.vcpuSeconds / 3600).toFixed(2)]], usage.items || []) : null,
    h("h2", {}, "Identities"),
    table("Identities", [["Name", (i) => i.name], ["Kind", (i) => i.kind], ["Id", (i) => h("span", { class: "mono" }, i.id)]], identities),
    h("h2", {}, "Tokens"),
    table("Tokens", [["State", (t) => badge(t.revokedAt ? "revoked" : "active")], ["Name", (t) => t.name], ["Identity", (t) => t.identityId], ["Expires", (t) => when(t.expiresAt)],
                     ["Id", (t) => h("span", { class: "mono" }, t.id)]], tokens)];
}

// ---- Shell ---------------------------------------------------------------------------------------

function route() {
  const parts = location.hash.replace(/^#\/?/, "").split("/");
  return { page: parts[0] || (state.operator ? "fleet" : "reservations"), arg: parts[1] };
}

function renderNav(current) {
  const nav = document.getElementById("nav");
  nav.replaceChildren(...PAGES.filter((p) => !p.operator || state.operator).map((p) =>
    h("a", { href: `#/${p.id}`, "aria-current": p.id === current ? "page" : null }, p.title)));
}

async function render() {
  const main = document.getElementById("main");
  if (!state.token) return loginPage(main);
  const { page, arg } = route();
  renderNav(page === "node" ? "fleet" : page);
  const run = page === "node" ? () => nodePage(arg) : (PAGES.find((p) => p.id === page) || PAGES[1]).render;
  const started = (state.rendering = {});
  try {
    const content = await run();
    if (state.rendering !== started) return; // a newer render is under way
    const focus = document.activeElement?.name;
    main.replaceChildren(...content);
    main.setAttribute("data-page", page);
    // A live re-render keeps what someone is typing: a form's fields get their draft values back.
    const drafts = state.drafts[page] || {};
    for (const field of main.querySelectorAll("form [name]")) {
      if (field.name in drafts) field.value = drafts[field.name];
      field.addEventListener("input", () => { (state.drafts[page] ||= {})[field.name] = field.value; });
    }
    if (focus) main.querySelector(`form [name="${CSS.escape(focus)}"]`)?.focus();
  } catch (e) {
    if (e instanceof ApiError && e.status === 403) {
      main.replaceChildren(h("h1", {}, "Not allowed"), h("p", {}, `This token may not see this page (${e.message}).`));
    } else if (state.token) {
      say(`${e.code || "ERROR"}: ${e.message}`);
    }
  }
}

function loginPage(main) {
  document.getElementById("nav").replaceChildren();
  document.getElementById("signout").hidden = true;
  main.replaceChildren(h("div", { class: "login" },
    h("h1", {}, "Sign in"),
    h("p", {}, "With an API token (bct_…): `better-compute api tokens.create`, or the one `dev` prints. It stays in this tab only."),
    h("form", { onsubmit: async (e) => {
      e.preventDefault();
      state.token = new FormData(e.target).get("token").trim();
      try {
        await api("reservations.list", { pageSize: 1 }).catch((err) => { if (err.status !== 403) throw err; });
        sessionStorage.setItem(TOKEN_KEY, state.token);
        say("");
        start();
      } catch (err) {
        state.token = null;
        say(`Sign in: ${err.code}: ${err.message}`);
      }
    } },
    h("label", { for: "token" }, "API token", h("input", { id: "token", name: "token", type: "password", autocomplete: "off", required: true })),
    h("p", {}, h("button", { type: "submit" }, "Sign in")))));
  document.getElementById("token").focus();
}

function signOut(why) {
  sessionStorage.removeItem(TOKEN_KEY);
  state.token = null;
  state.watching?.abort();
  document.getElementById("live").textContent = "";
  if (why) say(why);
  render();
}

async function start() {
  // Operator pages show when the token may read the fleet's nodes.
  state.operator = await api("nodes.list", { pageSize: 1 }).then(() => true, () => false);
  document.getElementById("signout").hidden = false;
  render();
  watch();
}

document.getElementById("signout").addEventListener("click", () => signOut("Signed out."));
window.addEventListener("hashchange", render);
if (state.token) start(); else render();
