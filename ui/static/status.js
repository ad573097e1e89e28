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

  // Every time with its date and zone: "2026-12-05 08:28:17 CET" (the viewer's zone, named).
  const pad = (n) => String(n).padStart(2, "0");
  let zoneName = null;

  function zone(date) {
    if (zoneName === null) {
      try {
        const part = new Intl.DateTimeFormat([], { timeZoneName: "short" }).formatToParts(date).find((p) => p.type === "timeZoneName");
        zoneName = part ? part.value : "";
      } catch (err) {
        zoneName = "";
      }
    }
    return zoneName || utcOffset(-date.getTimezoneOffset() * 60);
  }

  const utcOffset = (sec) => "UTC" + (sec < 0 ? "−" : "+") + pad(Math.floor(Math.abs(sec) / 3600)) + ":" + pad(Math.floor(Math.abs(sec) % 3600 / 60));
  const ymd = (d, utc) => utc ? `${d.getUTCFullYear()}-${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())} ${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}:${pad(d.getUTCSeconds())}`
    : `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;

  function stamp(ts) {
    const d = new Date(ts * 1000);
    return ymd(d, false) + " " + zone(d);
  }

  // The device's own clock, in the device's zone (it may differ from the viewer's).
  function deviceClock(c) {
    if (!c || typeof c.now !== "number") return null;
    const off = c.utc_offset_s || 0;
    return ymd(new Date((c.now + off) * 1000), true) + " " + utcOffset(off) + (c.timezone ? " (" + c.timezone + ")" : "");
  }

  function when(ts) {
    if (typeof ts !== "number" || ts <= 0) return "never";
    const delta = ts - Date.now() / 1000;
    const rel = Math.abs(delta) < 1 ? "now" : delta < 0 ? duration(-delta) + " ago" : "in " + duration(delta);
    return stamp(ts) + " (" + rel + ")";
  }

  function timeEl(ts) {
    return h("time", { datetime: new Date(ts * 1000).toISOString() }, when(ts));
  }

  function mb(v) {
    if (typeof v !== "number") return "—";
    return v >= 1024 ? num(v / 1024, 1) + " GiB" : num(v, 0) + " MiB";
  }

  // A bucket URL may carry user:password@ — never show it, whatever the server sent.
  const noCredentials = (text) => String(text).replace(/\/\/[^/@\s]*@/g, "//***@");

  const STATE_CLASS = { AVAILABLE: "ok", DEGRADED: "warn", LOADING: "warn", START: "warn", UNLOADING: "info", END: "muted" };

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

  // ---- charts (inline SVG, drawn in a fixed viewBox that scales with the column) ----------
  // The viewBox scales with the column; its width is picked so that a 10-unit label stays
  // about 11-12 px on screen: a phone shows one chart per row, a desktop three.
  let CW = 300;
  const CH = 124;
  const PLOT = { left: 42, right: 8, top: 8, bottom: 22 };
  const chartWidth = () => (window.innerWidth < 600 ? 300 : 220);

  // Round an axis maximum up to 1, 2, 2.5 or 5 times a power of ten.
  function niceMax(v) {
    if (!(v > 0) || !isFinite(v)) return 1;
    const e = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * e * 1.0000001) return m * e;
    return 10 * e;
  }

  const tickText = (v) => (v === 0 ? "0" : String(+v.toPrecision(3)));

  // Axes, grid lines and tick labels of one plot; returns the scale functions.
  function axes(svg, { yMax, unit, xTicks, xMax, yTitle }) {
    const x0 = PLOT.left, x1 = CW - PLOT.right, y0 = CH - PLOT.bottom, y1 = PLOT.top;
    const sx = (x) => x0 + (x / xMax) * (x1 - x0);
    const sy = (y) => y0 - (y / yMax) * (y0 - y1);
    const yAxis = s("g", { class: "axis axis-y" });
    for (const t of [0, yMax / 2, yMax]) {
      yAxis.append(s("line", { class: t ? "grid" : "base", x1: x0, x2: x1, y1: num(sy(t), 1), y2: num(sy(t), 1) }),
        s("text", { x: x0 - 4, y: num(sy(t) + 3.5, 1), "text-anchor": "end" }, tickText(t) + (unit ? " " + unit : "")));
    }
    if (yTitle) {
      const ty = num((y0 + y1) / 2, 1);
      yAxis.append(s("text", { class: "axis-title", x: 7, y: ty, "text-anchor": "middle", transform: `rotate(-90 7 ${ty})` }, yTitle));
    }
    const xAxis = s("g", { class: "axis axis-x" }, s("line", { class: "base", x1: x0, x2: x0, y1: y0, y2: y1 }));
    for (const [x, label] of xTicks) {
      xAxis.append(s("text", { x: num(sx(x), 1), y: CH - 8, "text-anchor": x === 0 ? "start" : x === xMax ? "end" : "middle" }, label));
    }
    svg.append(yAxis, xAxis);
    return { sx, sy };
  }

  // A time chart of the last minute: one line per series, a dot on every value (a lone
  // value between empty buckets is a dot, not a dash), gaps where a bucket had no request.
  function timeChart({ id, title, unit, series, stats, any, scale = 1 }) {
    CW = chartWidth();
    const n = Math.max(...series.map((x) => (x.values || []).length)) || 12; // no data: the server's 12 × 5 s
    const all = series.flatMap((x) => (x.values || []).filter((v) => typeof v === "number").map((v) => v * scale));
    const yMax = niceMax(Math.max(0, ...all));
    const span = n * 5; // seconds: the server's buckets are 5 s, oldest first
    const svg = s("svg", { class: "chart-svg", viewBox: `0 0 ${CW} ${CH}`, role: "img" },
      s("title", null, title + " over the last minute"));
    const { sx, sy } = axes(svg, { yMax, unit, xMax: span, xTicks: [[0, "−" + span + " s"], [span / 2, "−" + span / 2 + " s"], [span, "now"]] });
    if (!any) {
      svg.append(s("text", { class: "empty", x: num((PLOT.left + CW - PLOT.right) / 2, 1), y: num(CH / 2, 1), "text-anchor": "middle" },
        "no requests in the last minute"));
    } else {
      for (const line of series) {
        const g = s("g", { class: "series " + line.cls });
        let seg = [];
        const flush = () => {
          if (seg.length > 1) g.append(s("polyline", { points: seg.join(" ") }));
          seg = [];
        };
        (line.values || []).forEach((v, i) => {
          if (typeof v !== "number") return flush();
          const px = num(sx(i * 5 + 2.5), 1), py = num(sy(v * scale), 1);
          seg.push(px + "," + py);
          g.append(s("circle", { class: "pt " + line.cls, cx: px, cy: py, r: 2.2 }));
        });
        flush();
        svg.append(g);
      }
    }
    return h("figure", { class: "chart", "data-chart": id },
      h("figcaption", null, h("span", { class: "chart-title" }, title),
        h("span", { class: "stats" }, stats.map(([cls, label, value]) =>
          h("span", { class: "stat" }, cls ? h("i", { class: "swatch " + cls, "aria-hidden": "true" }) : null,
            h("span", { class: "stat-label" }, label), " ", h("b", null, value))))),
      svg);
  }

  function histogram(counts) {
    const keys = Object.keys(counts || {}).sort((a, b) => Number(a) - Number(b));
    if (!keys.length) return h("p", { class: "muted" }, "no batches yet");
    CW = 300; // its column is wider than a time chart's (and as wide on a phone)
    const yMax = niceMax(Math.max(...keys.map((k) => counts[k])));
    const svg = s("svg", { class: "chart-svg hist", viewBox: `0 0 ${CW} ${CH}`, role: "img" },
      s("title", null, "executed batches by size (rows per batch)"));
    const { sx, sy } = axes(svg, { yMax, unit: "", xMax: keys.length, xTicks: [], yTitle: "batches" });
    const every = Math.ceil(keys.length / 12); // at most 12 size labels
    const slot = sx(1) - sx(0), bar = Math.min(28, slot * 0.75);
    keys.forEach((k, i) => {
      const cx = sx(i + 0.5), top = sy(counts[k]);
      svg.append(s("rect", { class: "bar", "data-size": k, x: num(cx - bar / 2, 1), y: num(top, 1), width: num(bar, 1),
        height: num(Math.max(1.5, sy(0) - top), 1) }, s("title", null, counts[k] + " batches of " + k + " rows")));
      if (i % every === 0) svg.append(s("text", { class: "bar-label", x: num(cx, 1), y: CH - 10, "text-anchor": "middle" }, k));
    });
    svg.append(s("text", { class: "axis-title", x: CW - PLOT.right, y: CH - 1, "text-anchor": "end" }, "rows per batch"));
    return svg;
  }

  // ---- sections ------------------------------------------------------------------------
  const KIND_LABEL = {
    model_not_serving: "not serving", target_not_reached: "target not reached", version_quarantined: "quarantined",
    version_degraded: "degraded", backend_failed: "backend failed", workers_down: "front workers",
    sync_failing: "sync failing", sync_refused: "sync refused", store: "model store", part_down: "down",
    state_database: "state database", fallback: "slower fallback",
  };

  // Never green while a problem stands. A model not serving: red "not ready". Every model
  // serving but something to act on (a version refused, a part down, even one that makes
  // /readyz 503 like a configured API port): amber "degraded", with the count.
  function renderHeader(st) {
    const dev = st.device || {}, svc = st.service || {};
    const problems = st.problems || [];
    document.getElementById("host").textContent = (dev.hostname || "") + (svc.device_id ? " · " + svc.device_id : "");
    const n = problems.length, count = n + (n === 1 ? " problem" : " problems");
    const models = Object.values(st.models || {});
    const serving = models.length > 0 && models.every((m) => m.serving_version !== null && m.serving_version !== undefined);
    const state = !svc.ready && !serving ? "not-ready" : n || !svc.ready ? "degraded" : "ready";
    const [text, cls] = state === "not-ready" ? ["not ready" + (n ? " · " + count : ""), "bad"]
      : state === "degraded" ? ["degraded · " + (n ? count : "not ready"), "warn"] : ["ready", "ok"];
    const ready = document.getElementById("ready");
    ready.textContent = text;
    ready.className = "badge " + cls;
    ready.dataset.state = state;
    document.title = (cls === "ok" ? "" : "(!) ") + (dev.hostname || "edge-appliance") + " · status";
  }

  function renderProblems(st) {
    const problems = st.problems || [];
    const box = document.getElementById("problems");
    box.hidden = !problems.length;
    box.querySelector("h2").textContent = problems.length === 1 ? "1 problem" : problems.length + " problems";
    box.querySelector(".problem-list").replaceChildren(...problems.map((p) => h("li", {
      class: "problem sev-" + (p.severity || "warning"), "data-kind": p.kind, "data-model": p.model,
      "data-version": p.version, "data-part": p.part,
    },
    h("div", { class: "problem-head" },
      h("span", { class: "badge " + (p.severity === "error" ? "bad" : "warn") },
        p.kind === "part_down" ? (p.part || "part") + " down" : KIND_LABEL[p.kind] || p.kind),
      p.model ? h("span", { class: "problem-what" }, p.model + (p.version != null ? " v" + p.version : "")) : null,
      p.error_code ? h("span", { class: "code" }, p.error_code) : null,
      typeof p.since === "number" ? h("span", { class: "muted" }, "since ", timeEl(p.since)) : null),
    h("div", { class: "problem-msg" }, noCredentials(p.message)))));
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
      ["Device clock", deviceClock(svc.clock)],
      ["Service started", typeof svc.started === "number" ? when(svc.started) : duration(svc.uptime_s)],
      ["System uptime", d.boot_time ? duration(Date.now() / 1000 - d.boot_time) : null],
      ...serviceRows(st),
      ["CPU", `${d.cpu_count || "?"} cores`],
      ["Machine CPU", typeof d.cpu_percent === "number" ? num(d.cpu_percent) + " % of all cores (every process)" : null],
      ["Load average", `${num(d.load_1m, 2)} (1 min) · ${num(d.load_5m, 2)} (5 min)`],
      ["Machine memory", [meter(memUsed, memTotal), `${mb(memUsed)} used of ${mb(memTotal)}`]],
      ["Disk free", [meter(diskUsed, d.disk_total_mb), `${mb(d.disk_free_mb)} free of ${mb(d.disk_total_mb)} (state dir)`]],
      ["Temperatures", temps.length ? temps.map(([k, v]) => h("span", { class: "chip" }, `${k} ${num(v)}°C`)) : "not reported"],
      ["GPU", (d.gpu_name || d.nvidia_gpu ? gpu : "none found") + (d.tensorrt ? " · TensorRT" : "")],
      ["Delegates", delegates.length ? delegates.join(", ") : "none (CPU)"],
      ["Runtimes", `TensorFlow ${d.tensorflow_version ? d.tensorflow_version + tfBuild(d) : "absent"} · LiteRT ${d.litert || "absent"}`],
      ["System", `${d.system || "?"} ${d.machine || ""} · Python ${d.python || "?"}`],
      ["Last model scan", when(svc.last_poll)],
    ]));
  }

  const bytesMb = (b) => (typeof b === "number" ? mb(b / 1048576) : "—");

  // The service as a whole: its process tree's memory and CPU, where it listens, its workers
  // and its admin token (where it comes from, never the token).
  function serviceRows(st) {
    const f = st.footprint || {}, l = st.listening || {}, rest = l.rest || {};
    const procs = f.per_process || [];
    const workers = Array.isArray(st.workers) ? st.workers : [];
    const up = workers.filter((w) => w.up).length;
    const admin = (st.security && st.security.scopes && st.security.scopes.admin) || (l.admin_token && l.admin_token.source);
    return [
      ["Service memory", procs.length ? [
        `${bytesMb(f.pss_bytes)} PSS · ${bytesMb(f.rss_bytes)} RSS, ${f.processes} ${f.processes === 1 ? "process" : "processes"}`,
        h("div", { class: "muted" }, procs.map((p) => `${p.role} ${bytesMb(p.pss_bytes ?? p.rss_bytes)}`).join(" · "))] : null],
      ["Service CPU", typeof f.cpu_percent === "number"
        ? `${num(f.cpu_percent)} % of one core (${num(f.cpu_percent_of_machine)} % of the ${f.cpu_cores}-core machine), since the last update` : "—"],
      ["REST", rest.url ? `${rest.url} (${rest.host === "0.0.0.0" || rest.host === "::" ? "every address, port " + rest.port : "only " + rest.host}) · ${rest.served_by}` : null],
      ["REST socket", l.rest_socket || undefined, "path"],
      ["gRPC", l.grpc ? (l.grpc.length ? l.grpc.map((a) => h("span", { class: "chip" }, a))
        : (l.grpc_configured || []).length ? "not listening (configured: " + l.grpc_configured.join(", ") + ")" : "off") : undefined,
      l.grpc && !l.grpc.length && (l.grpc_configured || []).length ? "err" : null],
      ["Front workers", workers.length ? `${up} of ${workers.length} up` + (workers.some((w) => w.restarts) ? ` · ${workers.reduce((n, w) => n + (w.restarts || 0), 0)} restarts` : "") : (l.rest ? "none (one process)" : undefined)],
      ["Admin token", admin ? (admin === "off" ? "none: admin endpoints are off" : admin) : undefined],
    ];
  }

  // The build is what the wheel was compiled for, not what this box can use: the plain
  // "tensorflow" wheel on Linux is a CUDA build even where no GPU exists.
  function tfBuild(d) {
    if (d.tensorflow_build === "cuda") return d.nvidia_gpu ? " (CUDA, on the GPU)" : " (built with CUDA, no GPU found: runs on the CPU)";
    if (d.tensorflow_build === "cpu") return " (CPU build)";
    return d.tensorflow_build ? " (" + d.tensorflow_build + " build)" : "";
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
    body.replaceChildren(...names.map((name) => modelCard(name, models[name], st.problems || [])));
  }

  function modelCard(name, m, problems) {
    // A quarantine's reason is said once: in its problem at the top when there is one.
    const listed = (v) => problems.some((p) => p.kind === "version_quarantined" && p.model === name && String(p.version) === v);
    const versions = m.versions || [];
    const quarantined = Object.keys(m.quarantined || {}).sort((a, b) => Number(a) - Number(b));
    const serving = versions.find((v) => v.version === m.serving_version);
    const labels = Object.entries(m.labels || {});
    return h("article", { class: "card model" },
      h("header", { class: "model-head" },
        h("h3", { class: "model-name" }, name),
        m.serving_version != null
          ? h("span", { class: "badge ok" }, "serving v" + m.serving_version + (serving && serving.backend ? " on " + serving.backend : ""))
          : h("span", { class: "badge bad" }, "not serving"),
        quarantined.map((v) => h("span", { class: "badge bad quarantine" }, "v" + v + " quarantined"))),
      kv([
        ["Base path", m.base_path, "path"],
        ["Version policy", m.version_policy],
        ["Labels", labels.length ? labels.map(([l, v]) => h("span", { class: "chip" }, l + " → v" + v)) : "none"],
        ["Serving since", serving && serving.available_since ? when(serving.available_since) : null],
        ["Load time", serving ? `${num(serving.load_ms, 0)} ms (warm-up ${num(serving.warmup_ms, 0)} ms)` : null],
        ["Quarantined", quarantined.length ? quarantined.map((v) => h("div", null, "v" + v + ": " +
          (listed(v) ? "why: under Problems, at the top" : m.quarantined[v]))) : undefined, "err"],
        ["Last error", quarantined.length ? undefined : lastError(m), lastError(m) ? "err" : null],
      ]),
      requestCharts(m.requests || {}),
      serving ? batching(serving) : null,
      versionTable(versions, m.quarantined || {}),
      versions.map((v) => decision(name, v, v.version === m.serving_version, listed(String(v.version)))));
  }

  function lastError(m) {
    const v = (m.versions || []).find((x) => x.error);
    if (v) return "v" + v.version + ": " + v.error;
    const q = Object.entries(m.quarantined || {});
    return q.length ? q.map(([ver, why]) => "v" + ver + ": " + why).join("; ") : "";
  }

  function requestCharts(r) {
    const any = (r.series || []).some((v) => v > 0); // any request in the window
    const ms = (v) => (typeof v === "number" ? num(v, 2) + " ms" : "—");
    return h("div", { class: "charts" },
      timeChart({ id: "rate", title: "Requests", unit: "/s", any, series: [{ cls: "rate", values: r.series }],
        stats: [[null, "now", num(r.requests_per_s, 2) + " /s"]] }),
      timeChart({ id: "latency", title: "Latency", unit: "ms", any,
        series: [{ cls: "p50", values: r.p50_series }, { cls: "p99", values: r.p99_series }],
        stats: [["p50", "p50", ms(r.p50_ms)], ["p99", "p99", ms(r.p99_ms)]] }),
      // Errors: the server's failures (5xx) only; a client's bad request (4xx) is counted apart.
      timeChart({ id: "errors", title: "Errors", unit: "%", any, scale: 100,
        series: [{ cls: "err-rate", values: r.error_series }, { cls: "client-rate", values: r.client_error_series }],
        stats: [["err-rate", "server (5xx)", typeof r.error_rate === "number" ? num(r.error_rate * 100, 1) + " %" : "—"],
          ["client-rate", "client (4xx)", typeof r.client_error_rate === "number" ? num(r.client_error_rate * 100, 1) + " %" : "—"]] }));
  }

  function batching(v) {
    const b = v.batching;
    if (!b) return h("p", { class: "muted" }, "batching off for v" + v.version);
    return h("div", { class: "batching" },
      h("h4", null, "Batching ", h("small", null, "v" + v.version)),
      h("div", { class: "batch-grid" },
        h("figure", { class: "chart", "data-chart": "batch-sizes" },
          h("figcaption", null, h("span", { class: "chart-title" }, "Batch sizes"),
            h("span", { class: "stats" }, h("span", { class: "stat" }, h("span", { class: "stat-label" }, "mean"), " ",
              h("b", null, num(b.mean_batch_size, 2) + (b.mean_batch_size === 1 ? " row" : " rows"))))),
          histogram(b.batch_size_histogram)),
        kv([
          ["Queue depth", String(b.queue_depth_rows ?? "—") + " rows"],
          ["Batches", `${b.batches} (mean ${num(b.mean_batch_size, 2)} rows)`],
          ["Queue / run", `${num(b.mean_queue_ms, 2)} / ${num(b.mean_run_ms, 2)} ms`],
          ["Refused (full)", String(b.rejected_full ?? 0), b.rejected_full ? "err" : null],
        ])));
  }

  function versionTable(versions, quarantined) {
    if (!versions.length) return h("p", { class: "muted" }, "no version directories yet");
    return h("div", { class: "scroll" }, h("table", { class: "versions" },
      h("thead", null, h("tr", null, ["version", "state", "backend", "load", "in flight"].map((t) => h("th", null, t)))),
      h("tbody", null, versions.map((v) => h("tr", { "data-version": v.version },
        h("td", null, "v" + v.version),
        h("td", null, String(v.version) in quarantined
          ? [h("span", { class: "badge bad", title: quarantined[String(v.version)] }, "quarantined"), " ", h("small", { class: "muted" }, v.state)]
          : stateBadge(v.state, v.error)),
        h("td", null, v.backend || "—"),
        h("td", null, v.load_ms ? num(v.load_ms, 0) + " ms" : "—"),
        h("td", null, String(v.in_flight ?? 0)))))));
  }

  // One block per backend considered (not a wide table: it must read on a phone).
  function decision(model, v, isServing, said) {
    const d = v.decision;
    if (!d) return null;
    const key = model + "\u0000" + v.version;
    const open = openDetails.has(key) ? openDetails.get(key) : isServing;
    const el = h("details", { class: "decision", open: open },
      h("summary", null, `Backend decision v${v.version}: `, h("b", null, d.chosen || "none"),
        d.how ? ` (${d.how})` : "", " — ", said && !d.chosen ? "failed: why under Problems, at the top" : d.reason || ""),
      h("ul", { class: "considered" }, (d.considered || []).map((c) => h("li", { class: c.backend === d.chosen ? "chosen" : null },
        h("div", { class: "be-head" },
          h("b", null, c.backend),
          c.backend === d.chosen ? h("span", { class: "badge ok" }, "chosen")
            : c.load_error ? h("span", { class: "badge bad" }, "failed to load")
              : h("span", { class: "badge " + (c.available ? "info" : "muted") }, c.available ? "usable" : "not usable"),
          measured(c)),
        h("div", { class: "why" }, c.reason || ""),
        c.load_error ? h("div", { class: "err" }, "load error: " + (said ? "why: under Problems, at the top" : c.load_error)) : null))));
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
      syncBody.replaceChildren(...syncView(sync, st.events || [], st));
    } else {
      const bucket = st.config && st.config.sync && st.config.sync.bucket;
      syncBody.replaceChildren(h("p", { class: "muted" }, "sync not configured" +
        (bucket ? " (a bucket is set in the config, but the sync part is not running)" : "")));
    }
    const disc = st.discovery;
    const discSection = document.getElementById("discovery");
    discSection.hidden = !(disc && typeof disc === "object");
    if (disc && typeof disc === "object") {
      const down = disc.enabled && disc.error;
      discSection.classList.toggle("is-down", Boolean(down));
      section("discovery").replaceChildren(
        partState(down ? ["warn", "down: not announcing"] : !disc.enabled ? ["muted", "off"]
          : disc.announcing && disc.loopback_only ? ["info", "loopback only: not visible on the LAN"]
            : disc.announcing ? ["ok", "announcing"] : ["info", "starting"]),
        genericKV(disc, ["enabled", "announcing", "error", "name", "type", "port", "addresses", "loopback_only"]));
    }
  }

  function partState([cls, text]) {
    return h("p", { class: "part-state" }, h("span", { class: "badge " + cls }, text));
  }

  // The sync card: state first; a refusal (the bucket offers a version this device will not
  // take) is said in words with the reason from its event; empty lists are left out.
  function syncView(sync, events, st) {
    const failing = sync.failures > 0;
    const refusing = !failing && sync.last_error ? String(sync.last_error) : "";
    const refusals = [];
    const seenRefusal = new Set();
    for (const e of [...events].sort((a, b) => (b.id || 0) - (a.id || 0))) {
      if (e.kind !== "sync_refused") continue;
      const key = e.model + "\u0000" + e.version;
      if (seenRefusal.has(key) || !refusing.includes(e.model)) continue;
      seenRefusal.add(key);
      refusals.push(h("div", { class: "refusal" }, h("b", null, `${e.model} v${e.version}`), ": ",
        (e.detail && e.detail.reason) || e.message, " ", h("small", { class: "muted" }, "(" + when(e.ts) + ")")));
    }
    if (refusing && !refusals.length) refusals.push(h("div", { class: "refusal" }, noCredentials(refusing)));
    const pins = sync.pins || {};
    const targets = Object.entries(sync.targets || {}).map(([m, v]) => [m, pins[m] ?? v]);
    const models = st.models || {};
    // In step only when every target serves (a candidate under judgment counts as on its way).
    const behind = targets.filter(([m, v]) => models[m] && models[m].serving_version !== v && models[m].candidate_version !== v);
    const stuck = (st.problems || []).some((p) => p.kind === "target_not_reached");
    const handled = ["bucket", "channel", "last_poll", "last_change", "next_poll", "last_error", "failures", "targets", "problems", "pins"];
    const rest = Object.fromEntries(Object.entries(sync).filter(([k]) => !handled.includes(k)));
    const problems = sync.problems || [];
    return [
      partState(failing ? ["warn", "down: bucket unreachable"] : refusing ? ["warn", "refusing a published version"]
        : stuck ? ["bad", "target not reached"] : behind.length ? ["info", "catching up with the bucket"]
          : sync.last_poll ? ["ok", "in step with the bucket"] : ["info", "first poll pending"]),
      kv([
        ["Bucket", value("bucket", sync.bucket), "path"],
        ["Channel", sync.channel || "newest version"],
        ["Last poll", when(sync.last_poll)],
        ["Last change", when(sync.last_change)],
        ["Next poll", sync.next_poll ? when(sync.next_poll) : null],
        ["Target", targets.length ? targets.map(([m, v]) => h("span", { class: "chip" + (behind.some(([b]) => b === m) ? " behind" : "") },
          m + " → v" + v + (pins[m] != null ? " (pinned)" : "") + (behind.some(([b]) => b === m) ? `, v${models[m].serving_version ?? "none"} serves` : ""))) : "none yet"],
        ["Refused", refusals.length ? [...refusals, h("div", { class: "muted" }, "not taken into the store; what was serving keeps serving")] : undefined, "warn-text"],
        ["Last error", failing ? noCredentials(sync.last_error) : undefined, "err"],
        ["Failed polls", failing ? String(sync.failures) : undefined, "err"],
        ["Store problems", problems.length ? problems.map((p) => h("div", null, noCredentials(p))) : undefined, "err"],
      ]),
      Object.keys(rest).length ? genericKV(rest, []) : null,
    ].filter(Boolean);
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
    if (typeof v === "object" && !Object.keys(v).length) return null;
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
      h("time", { datetime: new Date(e.ts * 1000).toISOString() }, stamp(e.ts)),
      h("span", { class: "badge " + eventClass(e.kind) }, e.kind),
      e.model ? h("span", { class: "ev-model" }, e.model + (e.version != null ? " v" + e.version : "")) : null,
      h("span", { class: "ev-msg" }, e.message)))));
  }

  // Reserved for authenticated admin actions (sync now, rollback): see the security issue.
  // Until it lands the page stays read-only and this renders nothing.
  function renderAdmin() {}

  // ---- polling -------------------------------------------------------------------------
  function render(st) {
    for (const part of [renderHeader, renderProblems, renderDevice, renderModels, renderParts, renderEvents, renderAdmin]) {
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
      ? "updated " + stamp(lastOk / 1000)
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
