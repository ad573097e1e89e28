/* edge-appliance status page: polls /api/status every 2 s and redraws the sections.
 *
 * Safety rule for this file: data from the device (model names, paths, errors, bucket
 * names, event messages) only ever reaches the DOM as text — through h() below, which
 * uses createElement/textContent/setAttribute — never through innerHTML.
 * Each section renders from its own part of the status, so parts that land later
 * (sync, discovery, admin) fill in without touching the others.
 */
"use strict";
(function () {
  const POLL_MS = 2000;
  const FETCH_TIMEOUT_MS = 5000;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const openDetails = new Map(); // "model/version" -> open?, kept across redraws
  let lastOk = 0;
  let timer = null;
  let inFlight = false; // one request at a time, whatever wakes the poller

  // ---- DOM helpers (text only) -----------------------------------------------------
  function h(tag, attrs, ...kids) {
    return fill(document.createElement(tag), attrs, kids);
  }

  function s(tag, attrs, ...kids) {
    return fill(document.createElementNS(SVG_NS, tag), attrs, kids);
  }

  function fill(el, attrs, kids) {
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.setAttribute("class", v);
      else el.setAttribute(k, v === true ? "" : String(v));
    }
    for (const kid of kids.flat(Infinity)) {
      if (kid === null || kid === undefined || kid === false) continue;
      el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
    return el;
  }

  function section(id) {
    return document.querySelector("#" + id + " > .body");
  }

  function kv(rows) {
    const dl = h("dl", { class: "kv" });
    for (const [label, value, cls] of rows) {
      if (value === undefined) continue;
      dl.append(h("dt", null, label), h("dd", { class: cls || null }, value === null || value === "" ? "—" : value));
    }
    return dl;
  }

  // ---- formatting --------------------------------------------------------------------
  const num = (v, digits = 1) => (typeof v === "number" && isFinite(v) ? v.toFixed(digits).replace(/\.0+$/, "") : "—");

  function duration(sec) {
    if (typeof sec !== "number" || !isFinite(sec)) return "—";
    sec = Math.max(0, Math.round(sec));
    const d = Math.floor(sec / 86400), hh = Math.floor((sec % 86400) / 3600);
    const m = Math.floor((sec % 3600) / 60), ss = sec % 60;
    if (d) return d + "d " + hh + "h";
    if (hh) return hh + "h " + m + "m";
    if (m) return m + "m " + ss + "s";
    return ss + "s";
  }

  function clock(ts) {
    return new Date(ts * 1000).toLocaleTimeString([], { hour12: false });
  }

  function when(ts) {
    if (typeof ts !== "number" || ts <= 0) return "never";
    const delta = ts - Date.now() / 1000;
    const rel = Math.abs(delta) < 1 ? "now" : delta < 0 ? duration(-delta) + " ago" : "in " + duration(delta);
    return clock(ts) + " (" + rel + ")";
  }

  function mb(v) {
    if (typeof v !== "number") return "—";
    return v >= 1024 ? num(v / 1024, 1) + " GiB" : num(v, 0) + " MiB";
  }

  // A bucket URL may carry user:password@ — never show it, whatever the server sent.
  const noCredentials = (text) => String(text).replace(/\/\/[^/@\s]*@/g, "//***@");

  const STATE_CLASS = { AVAILABLE: "ok", LOADING: "warn", START: "warn", UNLOADING: "info", END: "muted" };

  function stateBadge(state, error) {
    const cls = error ? "bad" : STATE_CLASS[state] || "muted";
    return h("span", { class: "badge " + cls }, state || "?");
  }

  function eventClass(kind) {
    const k = String(kind || "").toLowerCase();
    if (/fail|error|refus|reject|corrupt/.test(k)) return "bad";
    if (/rollback|unload|stop|quarantin|stall/.test(k)) return "warn";
    if (/loaded|swap|start|commit|promot|ready/.test(k)) return "ok";
    return "muted";
  }

  // ---- small charts (inline SVG) ---------------------------------------------------
  function sparkline(values, label, current, any) {
    const w = 120, ht = 30, pad = 2;
    const nums = (values || []).filter((v) => typeof v === "number");
    const max = Math.max(1e-9, ...nums);
    const step = values && values.length > 1 ? (w - 2 * pad) / (values.length - 1) : 0;
    // Stretched to the column width (preserveAspectRatio none): only strokes, no text or dots.
    const svg = s("svg", { class: "spark", viewBox: `0 0 ${w} ${ht}`, preserveAspectRatio: "none", role: "img" },
      s("title", null, label + " over the last minute"));
    let seg = [];
    const flush = () => {
      if (seg.length === 1) seg.push([seg[0][0] + 1.5, seg[0][1]]), seg[0] = [seg[0][0] - 1.5, seg[0][1]];
      if (seg.length) svg.append(s("polyline", { points: seg.map((p) => p.map((x) => num(x, 1)).join(",")).join(" ") }));
      seg = [];
    };
    (values || []).forEach((v, i) => {
      if (typeof v !== "number") return flush();
      seg.push([pad + i * step, ht - pad - (v / max) * (ht - 2 * pad)]);
    });
    flush();
    const plot = any ? svg : h("div", { class: "spark-empty" }, "no requests");
    return h("figure", { class: "chart" }, h("figcaption", null, label, h("b", null, current)), plot);
  }

  function histogram(counts) {
    const keys = Object.keys(counts || {}).sort((a, b) => Number(a) - Number(b));
    if (!keys.length) return h("p", { class: "muted" }, "no batches yet");
    const w = Math.max(120, keys.length * 26), ht = 44, bar = w / keys.length;
    const max = Math.max(...keys.map((k) => counts[k]));
    const svg = s("svg", { class: "hist", viewBox: `0 0 ${w} ${ht}`, width: w, height: ht, role: "img" },
      s("title", null, "executed batches by size (rows)"));
    keys.forEach((k, i) => {
      const bh = Math.max(1, (counts[k] / max) * (ht - 14));
      svg.append(s("rect", { x: num(i * bar + 2, 1), y: num(ht - 12 - bh, 1), width: num(bar - 4, 1), height: num(bh, 1) },
        s("title", null, counts[k] + " batches of " + k)));
      svg.append(s("text", { x: num(i * bar + bar / 2, 1), y: ht - 2, "text-anchor": "middle" }, k));
    });
    return svg;
  }

  // ---- sections ------------------------------------------------------------------------
  function renderHeader(st) {
    const dev = st.device || {}, svc = st.service || {};
    document.getElementById("host").textContent = (dev.hostname || "") + (svc.device_id ? " · " + svc.device_id : "");
    const ready = document.getElementById("ready");
    ready.textContent = svc.ready ? "ready" : "not ready";
    ready.className = "badge " + (svc.ready ? "ok" : "bad");
    document.title = (svc.ready ? "" : "(!) ") + (dev.hostname || "edge-appliance") + " · status";
    let banner = document.getElementById("problems");
    if (!banner) {
      banner = h("ul", { id: "problems", class: "problems bad" });
      ready.closest("header") ? ready.closest("header").after(banner) : document.body.prepend(banner);
    }
    banner.replaceChildren(...(st.problems || []).map((p) => h("li", null, p)));
    banner.hidden = !(st.problems || []).length;
  }

  function renderDevice(st) {
    const d = st.device || {}, svc = st.service || {};
    const temps = Object.entries(d.temperatures_c || {});
    const gpu = d.gpu_name || (d.nvidia_gpu ? "NVIDIA GPU" : "none");
    const delegates = Object.entries(d.delegates || {}).filter(([, v]) => v).map(([k]) => k);
    const memUsed = d.memory_used_mb, memTotal = d.memory_mb;
    const diskUsed = d.disk_total_mb - d.disk_free_mb;
    section("device").replaceChildren(kv([
      ["Hostname", d.hostname],
      ["Device id", svc.device_id],
      ["Software", "edge-appliance " + (svc.version || "?")],
      ["Service uptime", duration(svc.uptime_s)],
      ["System uptime", d.boot_time ? duration(Date.now() / 1000 - d.boot_time) : null],
      ["CPU", `${d.cpu_count || "?"} cores · load ${num(d.load_1m, 2)} / ${num(d.load_5m, 2)} · ${num(d.cpu_percent)}%`],
      ["Memory", [meter(memUsed, memTotal), `${mb(memUsed)} used of ${mb(memTotal)} · process ${mb(d.process_rss_mb)}`]],
      ["Disk free", [meter(diskUsed, d.disk_total_mb), `${mb(d.disk_free_mb)} free of ${mb(d.disk_total_mb)} (state dir)`]],
      ["Temperatures", temps.length ? temps.map(([k, v]) => h("span", { class: "chip" }, `${k} ${num(v)}°C`)) : "not reported"],
      ["GPU", gpu + (d.tensorrt ? " · TensorRT" : "")],
      ["Delegates", delegates.length ? delegates.join(", ") : "none (CPU)"],
      ["Runtimes", `TensorFlow ${d.tensorflow_version || "absent"}${d.tensorflow_build ? " (" + d.tensorflow_build + ")" : ""} · LiteRT ${d.litert || "absent"}`],
      ["System", `${d.system || "?"} ${d.machine || ""} · Python ${d.python || "?"}`],
      ["Last model scan", when(svc.last_poll)],
    ]));
  }

  function meter(value, max) {
    if (typeof value !== "number" || typeof max !== "number" || !(max > 0)) return null;
    return h("meter", { min: 0, max: max, value: value, high: max * 0.9 });
  }

  function renderModels(st) {
    const models = st.models || {};
    const names = Object.keys(models).sort();
    const body = section("models");
    if (!names.length) return body.replaceChildren(h("p", { class: "card muted" }, "no models configured"));
    body.replaceChildren(...names.map((name) => modelCard(name, models[name])));
  }

  function modelCard(name, m) {
    const versions = m.versions || [];
    const serving = versions.find((v) => v.version === m.serving_version);
    const labels = Object.entries(m.labels || {});
    return h("article", { class: "card model" },
      h("header", { class: "model-head" },
        h("h3", { class: "model-name" }, name),
        m.serving_version != null
          ? h("span", { class: "badge ok" }, "serving v" + m.serving_version + (serving && serving.backend ? " on " + serving.backend : ""))
          : h("span", { class: "badge bad" }, "not serving")),
      kv([
        ["Base path", m.base_path, "path"],
        ["Version policy", m.version_policy],
        ["Labels", labels.length ? labels.map(([l, v]) => h("span", { class: "chip" }, l + " → v" + v)) : "none"],
        ["Serving since", serving && serving.available_since ? when(serving.available_since) : null],
        ["Load time", serving ? `${num(serving.load_ms, 0)} ms (warm-up ${num(serving.warmup_ms, 0)} ms)` : null],
        ["Last error", lastError(m), lastError(m) ? "err" : null],
      ]),
      requestCharts(m.requests || {}),
      serving ? batching(serving) : null,
      versionTable(versions),
      versions.map((v) => decision(name, v, v.version === m.serving_version)));
  }

  function lastError(m) {
    const v = (m.versions || []).find((x) => x.error);
    if (v) return "v" + v.version + ": " + v.error;
    const q = Object.entries(m.quarantined || {});
    return q.length ? q.map(([ver, why]) => "v" + ver + ": " + why).join("; ") : "";
  }

  function requestCharts(r) {
    const any = (r.series || []).some((v) => v > 0); // any request in the window
    return h("div", { class: "charts" },
      sparkline(r.series, "requests/s", num(r.requests_per_s, 2), any),
      sparkline(r.p50_series, "p50 ms", num(r.p50_ms, 2), any),
      sparkline(r.p99_series, "p99 ms", num(r.p99_ms, 2), any),
      sparkline(r.error_series, "error rate", typeof r.error_rate === "number" ? num(r.error_rate * 100, 1) + "%" : "—", any));
  }

  function batching(v) {
    const b = v.batching;
    if (!b) return h("p", { class: "muted" }, "batching off for v" + v.version);
    return h("div", { class: "batching" },
      h("h4", null, "Batching ", h("small", null, "v" + v.version)),
      h("div", { class: "batch-grid" },
        h("div", null, h("div", { class: "caption" }, "batch sizes"), histogram(b.batch_size_histogram)),
        kv([
          ["Queue depth", String(b.queue_depth_rows ?? "—") + " rows"],
          ["Batches", `${b.batches} (mean ${num(b.mean_batch_size, 2)} rows)`],
          ["Queue / run", `${num(b.mean_queue_ms, 2)} / ${num(b.mean_run_ms, 2)} ms`],
          ["Refused (full)", String(b.rejected_full ?? 0), b.rejected_full ? "err" : null],
        ])));
  }

  function versionTable(versions) {
    if (!versions.length) return h("p", { class: "muted" }, "no version directories yet");
    return h("div", { class: "scroll" }, h("table", { class: "versions" },
      h("thead", null, h("tr", null, ["version", "state", "backend", "load", "in flight"].map((t) => h("th", null, t)))),
      h("tbody", null, versions.map((v) => h("tr", { "data-version": v.version },
        h("td", null, "v" + v.version),
        h("td", null, stateBadge(v.state, v.error)),
        h("td", null, v.backend || "—"),
        h("td", null, v.load_ms ? num(v.load_ms, 0) + " ms" : "—"),
        h("td", null, String(v.in_flight ?? 0)))))));
  }

  // One block per backend considered (not a wide table: it must read on a phone).
  function decision(model, v, isServing) {
    const d = v.decision;
    if (!d) return null;
    const key = model + "\u0000" + v.version;
    const open = openDetails.has(key) ? openDetails.get(key) : isServing;
    const el = h("details", { class: "decision", open: open },
      h("summary", null, `Backend decision v${v.version}: `, h("b", null, d.chosen || "none"),
        d.how ? ` (${d.how})` : "", " — ", d.reason || ""),
      h("ul", { class: "considered" }, (d.considered || []).map((c) => h("li", { class: c.backend === d.chosen ? "chosen" : null },
        h("div", { class: "be-head" },
          h("b", null, c.backend),
          c.backend === d.chosen ? h("span", { class: "badge ok" }, "chosen")
            : h("span", { class: "badge " + (c.available ? "info" : "muted") }, c.available ? "usable" : "not usable"),
          measured(c)),
        h("div", { class: "why" }, c.reason || ""),
        c.load_error ? h("div", { class: "err" }, "load error: " + c.load_error) : null))));
    el.addEventListener("toggle", () => openDetails.set(key, el.open));
    return el;
  }

  function measured(c) {
    const parts = [];
    if (typeof c.batch1_ms === "number") parts.push("batch 1: " + num(c.batch1_ms, 3) + " ms");
    if (typeof c.batch_n_ms === "number") parts.push("batch N: " + num(c.batch_n_ms, 3) + " ms");
    return parts.length ? h("span", { class: "measured" }, parts.join(" · ")) : h("span", { class: "measured muted" }, "not timed");
  }

  // Optional parts report whatever they know; show every key, the usual ones first.
  function renderParts(st) {
    const sync = st.sync;
    const syncBody = section("sync");
    if (sync && typeof sync === "object") {
      syncBody.replaceChildren(genericKV(sync, ["bucket", "channel", "last_poll", "last_change", "next_poll", "last_error"]));
    } else {
      const bucket = st.config && st.config.sync && st.config.sync.bucket;
      syncBody.replaceChildren(h("p", { class: "muted" }, "sync not configured" +
        (bucket ? " (a bucket is set in the config, but the sync part is not running)" : "")));
    }
    const disc = st.discovery;
    document.getElementById("discovery").hidden = !(disc && typeof disc === "object");
    if (disc && typeof disc === "object") section("discovery").replaceChildren(genericKV(disc, ["enabled", "name", "type", "port", "addresses"]));
  }

  function genericKV(obj, first) {
    const keys = [...first.filter((k) => k in obj), ...Object.keys(obj).filter((k) => !first.includes(k))];
    return kv(keys.map((k) => {
      const err = /error/.test(k) && obj[k];
      return [k.replace(/_/g, " "), value(k, obj[k]), err ? "err" : null];
    }));
  }

  function value(key, v) {
    if (v === null || v === undefined || v === "") return null;
    if (typeof v === "number" && /(^|_)(last|next)(_|$)|_at$|^ts$|time|since/.test(key) && v > 1e9) return when(v);
    if (typeof v === "boolean") return v ? "yes" : "no";
    const scalar = (x) => x === null || typeof x !== "object";
    if (Array.isArray(v) && v.every(scalar)) return v.length ? v.map((x) => h("span", { class: "chip" }, noCredentials(x))) : null;
    if (typeof v === "object" && Object.values(v).every(scalar)) {
      return Object.entries(v).map(([k, x]) => h("span", { class: "chip" }, k + " = " + noCredentials(x)));
    }
    if (typeof v === "object") return h("code", { class: "json" }, noCredentials(JSON.stringify(v)));
    return noCredentials(v);
  }

  function renderEvents(st) {
    const events = [...(st.events || [])].sort((a, b) => (b.id || 0) - (a.id || 0) || (b.ts || 0) - (a.ts || 0));
    const body = section("events");
    if (!events.length) return body.replaceChildren(h("p", { class: "muted" }, "no events yet"));
    body.replaceChildren(h("ol", { class: "events" }, events.map((e) => h("li", { class: "event" },
      h("time", { datetime: new Date(e.ts * 1000).toISOString(), title: new Date(e.ts * 1000).toString() }, clock(e.ts)),
      h("span", { class: "badge " + eventClass(e.kind) }, e.kind),
      e.model ? h("span", { class: "ev-model" }, e.model + (e.version != null ? " v" + e.version : "")) : null,
      h("span", { class: "ev-msg" }, e.message)))));
  }

  // Reserved for authenticated admin actions (sync now, rollback): see the security issue.
  // Until it lands the page stays read-only and this renders nothing.
  function renderAdmin() {}

  // ---- polling -------------------------------------------------------------------------
  function render(st) {
    for (const part of [renderHeader, renderDevice, renderModels, renderParts, renderEvents, renderAdmin]) {
      try {
        part(st);
      } catch (err) { // one malformed part must not blank the whole page
        console.error(part.name, err);
      }
    }
    document.body.dataset.updated = String(Date.now());
  }

  function showConnection(ok, why) {
    const el = document.getElementById("conn");
    document.body.classList.toggle("stale", !ok);
    el.textContent = ok
      ? "updated " + clock(lastOk / 1000)
      : "connection lost (" + why + ") — retrying" + (lastOk ? "; last update " + duration((Date.now() - lastOk) / 1000) + " ago" : "");
  }

  async function poll() {
    clearTimeout(timer);
    if (inFlight || document.hidden) return; // a hidden tab is resumed by visibilitychange
    inFlight = true;
    const ctl = new AbortController();
    const abort = setTimeout(() => ctl.abort(), FETCH_TIMEOUT_MS);
    try {
      const res = await fetch("/api/status", { cache: "no-store", signal: ctl.signal, headers: { Accept: "application/json" } });
      if (!res.ok) throw new Error("HTTP " + res.status);
      const st = await res.json();
      lastOk = Date.now();
      render(st);
      showConnection(true);
    } catch (err) {
      showConnection(false, err.name === "AbortError" ? "timeout" : err.message);
    } finally {
      clearTimeout(abort);
      inFlight = false;
      timer = setTimeout(poll, POLL_MS);
    }
  }

  document.addEventListener("visibilitychange", () => { if (!document.hidden) poll(); });
  poll();
})();
