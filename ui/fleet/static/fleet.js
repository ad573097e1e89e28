// edge-appliance fleet page: reads /api/fleet (every device's row, the rollouts) and
// /api/devices/<id> (one report). Filters, sorting and pages run here over the rows, so
// 10,000 devices stay quick: only one page of rows is in the DOM. Every string from a
// report goes in with textContent, never as markup.
"use strict";

const REFRESH_MS = 10000;
const STATUS_ORDER = { unreadable: 0, unhealthy: 1, untrusted: 2, degraded: 3, stale: 4, ok: 5 };
const state = { data: null, rows: [], sortKey: "device_id", sortDir: 1, page: 0, size: 50, detail: "" };

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

function ago(seconds) {
  if (seconds == null) return "—";
  if (seconds < 120) return `${Math.round(seconds)} s ago`;
  if (seconds < 7200) return `${Math.round(seconds / 60)} min ago`;
  if (seconds < 172800) return `${(seconds / 3600).toFixed(1)} h ago`;
  return `${Math.round(seconds / 86400)} d ago`;
}

function when(epoch) {
  if (!epoch) return "—";
  return new Date(epoch * 1000).toLocaleString(undefined, { timeZoneName: "short" });
}

// In words, as `appliance fleet` prints it: "hpt v1; target v2 failed", never "hpt:1 (failed)".
function served(row) {
  const v = (n) => (n == null ? "nothing" : "v" + n);
  return Object.entries(row.models).map(([name, m]) => `${name} ${v(m.serving)}` +
    (m.state === "moving" ? `, moving to ${v(m.target)}` : m.state === "waiting" ? `; target ${v(m.target)} waits for its wave`
      : m.state === "failed" || m.state === "refused" ? `; target ${v(m.target)} ${m.state}` : "")).join("; ");
}

function problem(row) {
  if (row.error) return row.error;
  for (const m of Object.values(row.models)) if (m.reason && (m.state === "refused" || m.state === "failed")) return m.reason;
  return row.problems[0] || row.last_error || (row.anomalies || [])[0] || "";
}

// -- loading -------------------------------------------------------------------------------
async function load() {
  try {
    const response = await fetch("/api/fleet", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    state.data = await response.json();
    for (const row of state.data.devices) { row.served = served(row); row.problem = problem(row); }
    document.getElementById("conn").textContent = state.data.refresh_error ? `bucket: ${state.data.refresh_error}` : "";
    fillChoices();
    render();
  } catch (err) {
    document.getElementById("conn").textContent = `cannot read the fleet: ${err.message}`;
  }
}

function fillChoices() {
  const models = new Set(), channels = new Set();
  for (const row of state.data.devices) {
    Object.keys(row.models).forEach((m) => models.add(m));
    if (row.channel) channels.add(row.channel);
  }
  setOptions("f-model", [...models].sort());
  setOptions("f-channel", [...channels].sort());
}

function setOptions(id, values) {
  const select = document.getElementById(id);
  const keep = select.value;
  const have = [...select.options].slice(1).map((o) => o.value);
  if (have.join("\n") === values.join("\n")) return;
  select.replaceChildren(el("option", { value: "", text: "all" }), ...values.map((v) => el("option", { value: v, text: v })));
  select.value = values.includes(keep) ? keep : "";
}

// -- filters, sort, page ---------------------------------------------------------------------
function filtered() {
  const text = document.getElementById("f-text").value.trim().toLowerCase();
  const status = document.getElementById("f-status").value;
  const model = document.getElementById("f-model").value;
  const channel = document.getElementById("f-channel").value;
  const versionText = document.getElementById("f-version").value.trim();
  const trust = document.getElementById("f-trust").value;
  const version = versionText === "" ? null : Number(versionText);
  return state.data.devices.filter((row) => {
    if (text && !row.device_id.toLowerCase().includes(text) && !String(row.hostname || "").toLowerCase().includes(text)) return false;
    if (status === "attention" ? row.status === "ok" : status && row.status !== status) return false;
    if (model && !(model in row.models)) return false;
    if (channel && row.channel !== channel) return false;
    if (trust && row.trust !== trust) return false;
    if (version !== null) {
      const servedVersions = model ? [row.models[model].serving] : Object.values(row.models).map((m) => m.serving);
      if (!servedVersions.includes(version)) return false;
    }
    return true;
  });
}

function sortKey(row, key) {
  if (key === "status") return STATUS_ORDER[row.status];
  if (key === "models") return row.served;
  if (key === "age_s") return row.age_s;
  return String(row[key] ?? "");
}

function sorted(rows) {
  const key = state.sortKey, dir = state.sortDir;
  return rows.sort((a, b) => {
    const x = sortKey(a, key), y = sortKey(b, key);
    return (x < y ? -1 : x > y ? 1 : a.device_id < b.device_id ? -1 : 1) * dir;
  });
}

// -- rendering -------------------------------------------------------------------------------
function render() {
  const data = state.data;
  if (!data) return;
  document.getElementById("bucket").textContent = data.bucket;
  document.getElementById("generated").textContent = `read ${when(data.generated_at)} (${data.listing.reports} reports, ` +
    `${data.listing.fetched} read, ${data.listing.seconds.toFixed(2)} s)`;
  renderCounts(data.counts);
  renderRollouts(data.rollouts);
  state.rows = sorted(filtered());
  renderTable();
  document.body.dataset.updated = String(data.generated_at);
}

function renderCounts(counts) {
  const names = ["ok", "degraded", "unhealthy", "stale", "unreadable", "untrusted"];
  const chips = [el("span", { class: "count", id: "count-devices" }, el("b", { text: counts.devices.toLocaleString("en") }), " devices")];
  for (const name of names) {
    chips.push(el("button", { type: "button", class: `count s-${name}`, id: `count-${name}`,
      onclick: () => { document.getElementById("f-status").value = name; state.page = 0; render(); } },
      el("b", { text: String(counts[name]) }), ` ${name}`));
  }
  document.getElementById("counts").replaceChildren(...chips);
}

function renderRollouts(rollouts) {
  const body = document.querySelector("#rollouts .body");
  if (!rollouts.length) { body.replaceChildren(el("p", { class: "muted", text: "No device follows a channel." })); return; }
  body.replaceChildren(...rollouts.map(rolloutCard));
}

function rolloutCard(p) {
  const n = p.devices || 1;
  const failing = p.failing.length;
  const pct = (count) => `${(100 * count / n).toFixed(3)}%`;
  const bar = el("div", { class: "bar", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": "100",
    "aria-valuenow": String(p.on_target_percent), "aria-label": `${p.model} on version ${p.target_version}` });
  for (const [cls, count, title] of [["seg-on", p.on_target, "on target"], ["seg-fail", failing, "failing"],
    ["seg-moving", p.moving, "moving"], ["seg-waiting", p.waiting, "waiting for their wave"]]) {
    const seg = el("span", { class: cls, title: `${count} ${title}` });
    seg.style.width = pct(count);
    bar.append(seg);
  }
  const card = el("article", { class: "card rollout", "data-model": p.model, "data-channel": p.channel },
    el("h3", {}, el("span", { text: `${p.model} · ${p.channel} → version ${p.target_version ?? "—"}` }),
      el("span", { class: "pct", text: `${p.on_target_percent}%` })),
    bar,
    el("div", { class: "legend" },
      el("span", { text: `${p.on_target} of ${p.devices} on target` }),
      el("span", { text: `${failing} failing` }), el("span", { text: `${p.moving} moving` }),
      el("span", { text: `${p.waiting} waiting` }), el("span", { text: `${p.stale} stale` })));
  if (p.halted) card.append(el("div", { class: "halted", role: "alert", text: `Halted: ${p.halted_reason || "by hand"}` }));
  const waves = p.waves;
  if (waves.declared.length) {
    const next = waves.next_opens_at ? `; next opens ${when(waves.next_opens_at)}` : "";
    card.append(el("div", { class: "muted", text: `Waves: ${waves.open} of ${waves.total} open (${waves.open_percent}% of the fleet)${next}` }));
  }
  if (p.threshold) {
    const t = p.threshold;
    card.append(el("div", { class: t.breached ? "halted" : "muted",
      text: `Failure threshold ${t.percent}%: ${t.failing_in_open_waves} of ${t.devices_in_open_waves} in the open waves failing (${t.failing_percent}%)` }));
  }
  const others = Object.entries(p.on_other_versions).map(([v, c]) => `${v === "none" ? "nothing" : "v" + v}: ${c}`).join(", ");
  if (others) card.append(el("div", { class: "muted", text: `Still on: ${others}` }));
  if (failing) {
    card.append(el("ul", { class: "failing" }, ...p.failing.slice(0, 5).map((f) => el("li", {},
      el("button", { type: "button", class: "linkish", text: f.device_id, onclick: () => openDetail(f.device_id) }),
      `: ${f.state}: ${f.reason}`))));
    if (failing > 5) card.append(el("div", { class: "muted", text: `and ${failing - 5} more` }));
  }
  return card;
}

function renderTable() {
  const total = state.rows.length;
  const pages = Math.max(1, Math.ceil(total / state.size));
  state.page = Math.min(state.page, pages - 1);
  const start = state.page * state.size;
  const slice = state.rows.slice(start, start + state.size);
  document.querySelector("#table tbody").replaceChildren(...slice.map(rowNode));
  document.getElementById("range").textContent = total ?
    `${(start + 1).toLocaleString("en")}–${(start + slice.length).toLocaleString("en")} of ${total.toLocaleString("en")}` : "no devices match";
  document.getElementById("prev").disabled = state.page === 0;
  document.getElementById("next").disabled = state.page >= pages - 1;
  for (const th of document.querySelectorAll("#table th")) {
    th.setAttribute("aria-sort", th.dataset.key === state.sortKey ? (state.sortDir > 0 ? "ascending" : "descending") : "none");
  }
}

function rowNode(row) {
  return el("tr", { "data-device": row.device_id },
    el("td", {}, el("button", { type: "button", class: "linkish", text: row.device_id, onclick: () => openDetail(row.device_id) })),
    el("td", { text: row.hostname || "—" }),
    el("td", {}, el("span", { class: `badge ${row.status}`, text: row.status })),
    el("td", { text: row.channel || "—" }),
    el("td", { text: row.served || "—" }),
    el("td", { class: "num", title: when(row.stored_at || row.written_at), text: ago(row.age_s) }),
    el("td", {}, el("span", { class: row.trust === "signed" ? "badge ok" : row.trust === "unregistered" ? "badge stale" : "badge bad", text: row.trust })),
    el("td", { class: "problem", text: row.problem }));
}

// -- one device ------------------------------------------------------------------------------
async function openDetail(id) {
  state.detail = id;
  const panel = document.getElementById("detail");
  const body = panel.querySelector(".body");
  document.getElementById("detail-h").textContent = id;
  body.replaceChildren(el("p", { class: "muted", text: "loading…" }));
  panel.hidden = false;
  if (location.hash !== `#device=${encodeURIComponent(id)}`) history.replaceState(null, "", `#device=${encodeURIComponent(id)}`);
  try {
    const response = await fetch(`/api/devices/${encodeURIComponent(id)}`, { cache: "no-store" });
    const doc = await response.json();
    if (!response.ok) throw new Error(doc.error || `HTTP ${response.status}`);
    if (state.detail === id) body.replaceChildren(...detailNodes(doc.row, doc.report));
  } catch (err) {
    body.replaceChildren(el("p", { class: "s-unhealthy", text: `cannot read this device: ${err.message}` }));
  }
}

function kv(pairs) {
  const dl = el("dl", { class: "kv" });
  for (const [k, v] of pairs) dl.append(el("dt", { text: k }), el("dd", { text: v == null || v === "" ? "—" : String(v) }));
  return dl;
}

function detailNodes(row, report) {
  const nodes = [kv([["Status", row.status], ["Host", row.hostname], ["Channel", row.channel],
    ["Software", row.software_version], ["Report written", `${when(row.written_at)} (${ago(row.age_s)})`],
    ["Heartbeat", `${row.report_interval_s} s`], ["Report", row.trust], ["Why written", (report || {}).trigger],
    ["Problems", row.problems.join("; ")], ["Last sync error", row.last_error], ["Error", row.error]])];
  for (const [name, m] of Object.entries((report || {}).models || {})) {
    nodes.push(el("h3", { text: `${name}: serving ${m.serving_version ?? "nothing"}, aiming at ${m.target_version ?? "—"}` }));
    if (m.refused) nodes.push(el("p", { class: "s-unhealthy", text: `Refused version ${m.refused.version ?? ""}: ${m.refused.reason}` }));
    if (m.wave) nodes.push(el("p", { class: "muted", text: `Wave: ${m.wave.reason}` }));
    const table = el("table", {}, el("thead", {}, el("tr", {}, ...["Version", "State", "Backend", "Reason"].map((t) => el("th", { text: t })))));
    table.append(el("tbody", {}, ...(m.versions || []).map((v) => el("tr", {},
      el("td", { text: String(v.version) }), el("td", { text: v.state }), el("td", { text: v.backend || "—" }),
      el("td", { class: "problem", text: v.reason || "" })))));
    nodes.push(table);
  }
  nodes.push(el("h3", { text: "Report as written" }), el("pre", { text: JSON.stringify(report, null, 1) }));
  return nodes;
}

function closeDetail() {
  state.detail = "";
  document.getElementById("detail").hidden = true;
  history.replaceState(null, "", location.pathname);
}

// -- wiring ----------------------------------------------------------------------------------
function wire() {
  for (const id of ["f-text", "f-status", "f-model", "f-channel", "f-version", "f-trust"]) {
    document.getElementById(id).addEventListener("input", () => { state.page = 0; render(); });
  }
  document.getElementById("filters").addEventListener("submit", (e) => e.preventDefault());
  for (const th of document.querySelectorAll("#table th")) {
    th.querySelector("button").addEventListener("click", () => {
      state.sortDir = state.sortKey === th.dataset.key ? -state.sortDir : 1;
      state.sortKey = th.dataset.key;
      render();
    });
  }
  document.getElementById("prev").addEventListener("click", () => { state.page -= 1; renderTable(); });
  document.getElementById("next").addEventListener("click", () => { state.page += 1; renderTable(); });
  document.getElementById("size").addEventListener("change", (e) => { state.size = Number(e.target.value); state.page = 0; renderTable(); });
  document.getElementById("close").addEventListener("click", closeDetail);
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && state.detail) closeDetail(); });
  const match = location.hash.match(/^#device=(.+)$/);
  if (match) openDetail(decodeURIComponent(match[1]));
}

wire();
load();
setInterval(() => { if (!document.hidden) load(); }, REFRESH_MS);
