/* dpmesh control plane dashboard.
 *
 * The server pushes a full "snapshot" JSON object over a websocket every scrape interval; each
 * snapshot replaces the view state. This file renders it: fleet summary, policy control, the
 * per-rank table (updated in place), uPlot charts, and the benchmark runs.
 *
 * Plain ES2020, no build step. uPlot is vendored under vendor/uplot/ and loaded before this file.
 * window.renderSnapshot(snapshot) is exposed so a static page can render a sample without a server.
 */
(() => {
  "use strict";

  const DASH = "\u2013"; // shown for missing (null) values
  const GAP_WARN = 0.10; // |engine - router| hit rate beyond which the gap cell is highlighted
  const BACKOFF_MIN_MS = 1000;
  const BACKOFF_MAX_MS = 10000;
  const CLOSE_NOT_AUTHORIZED = 4403;
  const PALETTE = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f",
  ];

  const $ = (sel, root = document) => root.querySelector(sel);

  // ---------------------------------------------------------------- formatting

  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  // Integers without thousands separators: tests parse them.
  const fmtInt = (v) => (isNum(v) ? String(Math.round(v)) : DASH);
  const fmtPct = (v) => (isNum(v) ? (v * 100).toFixed(1) + "%" : DASH);
  const fmtFixed = (v, digits) => (isNum(v) ? v.toFixed(digits) : DASH);
  /** Bytes in MiB with one decimal (KV moved between prefill and decode ranks). */
  const fmtMiB = (v) => (isNum(v) ? (v / 1048576).toFixed(1) + " MiB" : DASH);

  /** A fraction difference as signed percentage points: 0.012 -> "+1.2 pp". */
  function fmtGap(v) {
    if (!isNum(v)) return DASH;
    const pp = Number((v * 100).toFixed(1));
    if (pp === 0) return "+0.0 pp"; // also catches -0
    return (pp > 0 ? "+" : "") + pp.toFixed(1) + " pp";
  }

  const pad2 = (n) => String(n).padStart(2, "0");
  const fmtClock = (d) => `${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;

  /** An ISO timestamp in local time: "HH:MM:SS" when today, else "YYYY-MM-DD HH:MM". */
  function fmtWhen(iso) {
    if (!iso) return DASH;
    const d = new Date(iso);
    if (Number.isNaN(d.getTime())) return String(iso);
    const now = new Date();
    if (d.toDateString() === now.toDateString()) return fmtClock(d);
    return `${d.getFullYear()}-${pad2(d.getMonth() + 1)}-${pad2(d.getDate())} ${pad2(d.getHours())}:${pad2(d.getMinutes())}`;
  }

  /** Set text only when it changed, so unchanged cells are not touched on every snapshot. */
  function setText(el, text) {
    if (el.textContent !== text) el.textContent = text;
  }

  function el(tag, attrs = {}, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // ---------------------------------------------------------------- state

  const state = {
    ws: null,
    backoffMs: BACKOFF_MIN_MS,
    reconnectTimer: null,
    stopped: false, // true after a 4403 close: no more reconnects
    pendingPolicy: null, // {name, until}: the select keeps the user's choice until confirmed
    workers: new Map(), // worker id -> {tbody, headerCell}
    rows: new Map(), // rank key -> {tr, cells: {field: td}}
    charts: { hit: null, rps: null, bench: null },
    hitKeys: "", // the rank keys the hit-rate chart was built for
    benchRunId: null, // the run #chart-bench currently shows
    benchTableKey: "", // what #bench-runs was last rendered from
    missesKey: "", // what #misses was last rendered from
    warnedNoUPlot: false,
  };

  // ---------------------------------------------------------------- flash / status line

  function flash(message) {
    const bar = $("#flash-bar");
    setText($("#flash"), String(message));
    bar.hidden = false;
  }

  function setConn(text, cls) {
    const node = $("#conn");
    setText(node, text);
    node.className = "conn-state " + cls;
  }

  // ---------------------------------------------------------------- fleet summary + policy

  function renderFleet(snap) {
    const f = snap.fleet || {};
    // the admission queue says why it holds requests back
    const queueState = f.draining ? " (draining)" : f.saturated ? " (fleet saturated)" : "";
    const fmt = {
      requests: fmtInt, prompt_tokens: fmtInt, inflight_requests: fmtInt,
      engine_hit_rate: fmtPct, router_hit_rate: fmtPct,
      requests_per_s: (v) => fmtFixed(v, 2), kv_bytes_pulled: fmtMiB,
      queue_depth: (v) => fmtInt(v) + queueState,
    };
    for (const node of document.querySelectorAll("#fleet [data-fleet]")) {
      const field = node.dataset.fleet;
      setText(node, (fmt[field] || fmtInt)(f[field]));
    }
    const queued = $('#fleet [data-fleet="queue_depth"]');
    if (queued) queued.classList.toggle("warn", (isNum(f.queue_depth) && f.queue_depth > 0) || !!f.draining);
    // why requests were refused: 429 queue_full, timeout; 503 draining
    const rejected = $("#fleet-rejected");
    if (rejected) {
      const reasons = f.rejected_by_reason || {};
      rejected.title = Object.keys(reasons).map((r) => `${r}: ${fmtInt(reasons[r])}`).join(", ");
    }
  }

  function renderPolicy(snap) {
    const select = $("#policy-select");
    // Keep the options in step with the server's list.
    const names = Array.isArray(snap.policies) ? snap.policies : null;
    if (names) {
      const current = Array.from(select.options, (o) => o.value);
      if (current.join("\n") !== names.join("\n")) {
        select.replaceChildren(...names.map((n) => el("option", { value: n }, n)));
      }
    }
    // While the user's change is in flight, do not flip the select back to the old policy.
    const pending = state.pendingPolicy;
    if (pending && (snap.policy === pending.name || Date.now() > pending.until)) state.pendingPolicy = null;
    if (!state.pendingPolicy && snap.policy && select.value !== snap.policy) select.value = snap.policy;

    let status = `active: ${snap.policy || DASH}`;
    if (snap.policy_updated_at || snap.policy_updated_by) {
      status += " · changed";
      if (snap.policy_updated_by) status += ` by ${snap.policy_updated_by}`;
      if (snap.policy_updated_at) status += ` at ${fmtWhen(snap.policy_updated_at)}`;
    } else {
      status += " (default)";
    }
    if (state.pendingPolicy) status += ` · switching to ${state.pendingPolicy.name}…`;
    setText($("#policy-status"), status);
  }

  function onPolicyChange() {
    const select = $("#policy-select");
    const name = select.value;
    if (!send({ action: "set_policy", policy: name })) {
      flash("not connected — the policy was not changed");
      if (window.lastSnapshot && window.lastSnapshot.policy) select.value = window.lastSnapshot.policy;
      return;
    }
    state.pendingPolicy = { name, until: Date.now() + 5000 };
    if (window.lastSnapshot) renderPolicy(window.lastSnapshot);
  }

  // ---------------------------------------------------------------- ranks table

  // [data-field, formatter, extra class]. Order = column order after the "rank" column.
  const RANK_COLUMNS = [
    ["requests", fmtInt, "num"],
    ["prompt_tokens", fmtInt, "num"],
    ["predicted_tokens", fmtInt, "num"],
    ["router_hit_rate", fmtPct, "num"],
    ["engine_requests", fmtInt, "num engine"],
    ["engine_prompt_tokens", fmtInt, "num engine"],
    ["engine_cached_tokens", fmtInt, "num engine"],
    ["engine_hit_rate", fmtPct, "num engine"],
    ["gap", fmtGap, "num engine"],
    ["inflight_requests", fmtInt, "num"],
    ["inflight_tokens", fmtInt, "num"],
    ["kv_blocks", null, "num"],
    ["kv_moved", null, "num engine"],
    ["health", null, "left"],
    ["circuit", null, "left"],
    ["index", null, "left"],
  ];
  const COLSPAN = String(RANK_COLUMNS.length + 1);

  function makeWorkerGroup() {
    const tbody = el("tbody", { class: "worker-group" });
    const tr = el("tr", { class: "worker-row" });
    const td = el("td", { colspan: COLSPAN });
    tr.append(td);
    tbody.append(tr);
    return { tbody, headerRow: tr, headerCell: td };
  }

  function badge(text, cls) {
    return el("span", { class: `badge ${cls}` }, text);
  }

  function healthClass(h) {
    return h === "healthy" ? "ok" : h === "unhealthy" ? "bad" : "unknown";
  }

  function updateWorkerHeader(group, w) {
    // The header is small and rarely changes: rebuild it only when its content would differ.
    const key = JSON.stringify([w.id, w.url, w.model, w.flavour, w.role, w.dp_size, w.health, w.health_detail, w.draining]);
    if (group.key === key) return;
    group.key = key;
    const parts = [
      el("span", { class: "worker-id" }, `worker ${w.id}`),
      el("span", { class: "worker-url", "data-worker-field": "url" }, w.url || DASH),
      el("span", { class: "muted" }, `model ${w.model || DASH}`),
      el("span", { class: "muted" }, `dp ${fmtInt(w.dp_size)}`),
      el("span", { class: "muted", "data-worker-field": "flavour" }, w.flavour || DASH),
      badge(w.health || "unknown", healthClass(w.health)),
    ];
    // prefill/decode disaggregation: the worker's role (none shown: it serves whole requests)
    if (w.role) parts.splice(5, 0, el("span", { class: "muted", "data-worker-field": "role" }, w.role));
    if (w.draining) parts.push(badge("draining", "warn"));
    if (w.health_detail) parts.push(el("span", { class: "muted small" }, w.health_detail));
    group.headerCell.replaceChildren(...parts);
    group.headerRow.dataset.worker = String(w.id);
  }

  function makeRankRow(key) {
    const tr = el("tr", { class: "rank-row", "data-target": key });
    const cells = {};
    const label = el("td", { class: "left rank-label", "data-field": "rank" });
    tr.append(label);
    cells.rank = label;
    for (const [field, , cls] of RANK_COLUMNS) {
      const td = el("td", { class: cls, "data-field": field }, DASH);
      tr.append(td);
      cells[field] = td;
    }
    return { tr, cells };
  }

  function updateRankRow(row, r, w, snap) {
    const c = row.cells;
    setText(c.rank, `${r.key}`);
    c.rank.title = `worker ${w.id} (${w.url || "?"}), DP rank ${r.rank}`;
    for (const [field, fmt] of RANK_COLUMNS) {
      if (fmt) setText(c[field], fmt(r[field]));
    }

    const used = r.kv_blocks_used, total = r.kv_blocks_total;
    setText(c.kv_blocks, used == null && total == null ? DASH : `${fmtInt(used)} / ${fmtInt(total)}`);

    // prefill/decode disaggregation: what a decode rank pulled, a prefill rank sent; on a decode
    // rank the router columns say how much of each prompt the index expected it to hold already
    // (transfer the routing saved), the engine columns the prefill side's cache hits
    const moved = r.role === "decode" ? r.kv_bytes_pulled : r.role === "prefill" ? r.kv_bytes_sent : null;
    setText(c.kv_moved, r.role ? `${r.role === "decode" ? "pulled" : "sent"} ${fmtMiB(moved)}` : DASH);
    c.kv_moved.title = r.role === "decode" ? `${fmtInt(r.kv_blocks_pulled)} blocks pulled from prefill ranks` : "";

    // A rank-level health, if the backend ever sends one, wins over the worker's.
    const health = r.health || w.health || "unknown";
    setText(c.health, health);
    c.health.className = `left state-${healthClass(health)}`;

    const circuit = r.circuit || "unknown";
    setText(c.circuit, circuit);
    const circuitCls = circuit === "closed" ? "ok" : circuit === "open" ? "bad" : circuit === "half_open" ? "warn" : "unknown";
    c.circuit.className = `left state-${circuitCls}`;

    // precise: the index follows the engine's KV events; a mismatch (block size, tokenizer) says why
    // they cannot match, instead of a silent 0 % hit rate
    const index = r.kv_events_mismatch ? "mismatch" : r.precise ? "precise" : "approximate";
    setText(c.index, index);
    c.index.className = `left state-${index === "precise" ? "ok" : index === "mismatch" ? "bad" : "unknown"}`;
    c.index.title = r.kv_events_mismatch || (r.precise ? "follows the engine's KV events" : "the router's own decisions only");

    c.gap.classList.toggle("warn", isNum(r.gap) && Math.abs(r.gap) > GAP_WARN);

    // Engine columns go grey when the engine's counters are older than three scrape intervals.
    const interval = isNum(snap.scrape_interval_s) ? snap.scrape_interval_s : 2;
    const age = isNum(r.scraped_at) && isNum(snap.at) ? snap.at - r.scraped_at : null;
    const stale = age === null || age > 3 * interval;
    for (const field of ["engine_requests", "engine_prompt_tokens", "engine_cached_tokens", "engine_hit_rate", "gap"]) {
      c[field].classList.toggle("stale", stale);
      c[field].title = age === null ? "engine not scraped yet" : `engine counters scraped ${age.toFixed(1)} s ago`;
    }

    row.tr.classList.toggle("unavailable", r.available === false);
    row.tr.title = r.available === false ? "not available for routing" : "";
  }

  function renderRanks(snap) {
    const table = $("#ranks");
    const placeholder = $("#ranks-empty");
    const workers = Array.isArray(snap.workers) ? snap.workers : [];
    const seenWorkers = new Set();
    const seenRanks = new Set();

    // Worker groups (one <tbody> each) follow the snapshot's order; nodes are reused and only
    // moved when out of place.
    let prev = table.tHead;
    for (const w of workers) {
      const wid = String(w.id);
      seenWorkers.add(wid);
      let group = state.workers.get(wid);
      if (!group) {
        group = makeWorkerGroup();
        state.workers.set(wid, group);
      }
      if (prev.nextSibling !== group.tbody) table.insertBefore(group.tbody, prev.nextSibling);
      prev = group.tbody;
      updateWorkerHeader(group, w);

      let prevRow = group.headerRow;
      for (const r of Array.isArray(w.ranks) ? w.ranks : []) {
        seenRanks.add(r.key);
        let row = state.rows.get(r.key);
        if (!row) {
          row = makeRankRow(r.key);
          state.rows.set(r.key, row);
        }
        if (prevRow.nextSibling !== row.tr) group.tbody.insertBefore(row.tr, prevRow.nextSibling);
        prevRow = row.tr;
        updateRankRow(row, r, w, snap);
      }
    }

    for (const [key, row] of state.rows) {
      if (!seenRanks.has(key)) {
        row.tr.remove();
        state.rows.delete(key);
      }
    }
    for (const [wid, group] of state.workers) {
      if (!seenWorkers.has(wid)) {
        group.tbody.remove();
        state.workers.delete(wid);
      }
    }

    placeholder.hidden = workers.length > 0;
    if (!workers.length) setText(placeholder.querySelector("td"), "no workers registered");
  }

  // ---------------------------------------------------------------- charts

  function haveUPlot() {
    if (typeof window.uPlot === "function") return true;
    if (!state.warnedNoUPlot) {
      state.warnedNoUPlot = true;
      flash("charting library failed to load; charts are disabled");
    }
    return false;
  }

  const toPct = (v) => (isNum(v) ? v * 100 : null);

  /** Pad/cut a series to n points so every uPlot series has the x axis' length. */
  function fit(arr, n, map = (v) => (isNum(v) ? v : null)) {
    const out = new Array(n);
    const src = Array.isArray(arr) ? arr : [];
    for (let i = 0; i < n; i++) out[i] = i < src.length ? map(src[i]) : null;
    return out;
  }

  function chartWidth(container) {
    return Math.max(240, Math.floor(container.clientWidth || 600));
  }

  /** Create a uPlot chart in container and keep its width following the container's. */
  function makeChart(container, opts, data) {
    container.replaceChildren();
    const chart = new window.uPlot({ ...opts, width: chartWidth(container) }, data, container);
    if ("ResizeObserver" in window) {
      let lastWidth = chartWidth(container);
      // Only width matters (the legend changes the container's height; reacting to that would loop).
      chart._dpResize = new ResizeObserver(() => {
        const w = chartWidth(container);
        if (w !== lastWidth) {
          lastWidth = w;
          chart.setSize({ width: w, height: opts.height });
        }
      });
      chart._dpResize.observe(container);
    }
    return chart;
  }

  function destroyChart(chart) {
    if (!chart) return;
    if (chart._dpResize) chart._dpResize.disconnect();
    chart.destroy();
  }

  const pctValue = (u, v) => (v == null ? DASH : v.toFixed(1) + "%");

  function renderHitChart(snap) {
    const series = snap.series || {};
    const t = Array.isArray(series.t) ? series.t : [];
    const n = t.length;
    const ranks = series.ranks || {};
    // Sort "1@0", "1@2", "1@10", "2@0" naturally.
    const keys = Object.keys(ranks).sort((a, b) => a.localeCompare(b, undefined, { numeric: true }));
    const data = [t.slice(), ...keys.map((k) => fit(ranks[k], n, toPct)), fit(series.fleet, n, toPct)];

    const signature = keys.join("|");
    if (state.charts.hit && state.hitKeys === signature) {
      state.charts.hit.setData(data);
      return;
    }
    // The set of ranks changed (or first render): rebuild with one series per rank.
    destroyChart(state.charts.hit);
    state.hitKeys = signature;
    const opts = {
      height: 280,
      scales: { x: { time: true }, y: { auto: false, range: [0, 100] } },
      axes: [{}, { values: (u, vals) => vals.map((v) => v + "%"), size: 50 }],
      series: [
        {},
        ...keys.map((k, i) => ({ label: k, stroke: PALETTE[i % PALETTE.length], width: 1.5, value: pctValue })),
        { label: "fleet", stroke: "#111", width: 3, value: pctValue },
      ],
    };
    state.charts.hit = makeChart($("#chart-hit-rate"), opts, data);
  }

  function renderRpsChart(snap) {
    const series = snap.series || {};
    const t = Array.isArray(series.t) ? series.t : [];
    const data = [t.slice(), fit(series.requests_per_s, t.length)];
    if (state.charts.rps) {
      state.charts.rps.setData(data);
      return;
    }
    const opts = {
      height: 280,
      scales: {
        x: { time: true },
        // Always start at 0; leave headroom above the peak.
        y: { range: (u, min, max) => [0, isNum(max) && max > 0 ? max * 1.15 : 1] },
      },
      axes: [{}, { size: 50 }],
      series: [
        {},
        { label: "requests/s", stroke: "#1f77b4", fill: "rgba(31,119,180,0.08)", width: 2,
          value: (u, v) => (v == null ? DASH : v.toFixed(2)) },
      ],
    };
    state.charts.rps = makeChart($("#chart-rps"), opts, data);
  }

  /** The newest finished run with TTFT stats, or null. */
  function latestFinishedRun(runs) {
    let best = null;
    for (const run of runs) {
      const res = run && run.result;
      if (run.status !== "done" || !res || !res.ttft_ms) continue;
      if (!best || run.id > best.id) best = run;
    }
    return best;
  }

  function renderBenchChart(runs) {
    const container = $("#chart-bench");
    const title = $("#chart-bench-title");
    const run = latestFinishedRun(runs);
    const ttft = run && Array.isArray(run.result.ttft_ms_series) ? run.result.ttft_ms_series : null;
    if (!run || !ttft) {
      destroyChart(state.charts.bench);
      state.charts.bench = null;
      state.benchRunId = null;
      setText(title, "TTFT per request");
      if (!container.querySelector(".placeholder")) {
        container.replaceChildren(el("p", { class: "placeholder" }, run ? `run #${run.id} has no per-request TTFT series` : "no finished run yet"));
      }
      return;
    }
    const dataset = (run.params && run.params.dataset) || "?";
    setText(title, `TTFT per request — run #${run.id} (${dataset}), in send order`);
    if (state.charts.bench && state.benchRunId === run.id) return; // a finished run does not change
    destroyChart(state.charts.bench);
    state.benchRunId = run.id;
    const data = [ttft.map((_, i) => i + 1), ttft.map((v) => (isNum(v) ? v : null))];
    const opts = {
      height: 240,
      scales: { x: { time: false }, y: { range: (u, min, max) => [0, isNum(max) && max > 0 ? max * 1.1 : 1] } },
      axes: [{ label: "request #" }, { label: "TTFT (ms)", size: 60 }],
      series: [
        { label: "request" },
        { label: "TTFT ms", stroke: "#9467bd", width: 1, points: { show: true, size: 5 },
          value: (u, v) => (v == null ? DASH : v.toFixed(1)) },
      ],
    };
    state.charts.bench = makeChart(container, opts, data);
  }

  // ---------------------------------------------------------------- benchmarks

  function renderBenchTable(runs) {
    // Rebuild only when something shown changed (per-request TTFT series excluded from the key).
    const key = JSON.stringify(runs.map((r) => [r.id, r.created_at, r.status, r.error, r.params,
      r.result && { ...r.result, ttft_ms_series: undefined }]));
    if (key === state.benchTableKey) return;
    state.benchTableKey = key;

    const tbody = $("#bench-runs tbody");
    if (!runs.length) {
      const tr = el("tr");
      tr.append(el("td", { colspan: "12", class: "placeholder" }, "no runs yet"));
      tbody.replaceChildren(tr);
      return;
    }
    const rows = [];
    for (const run of runs) {
      const p = run.params || {};
      const res = run.result || {};
      const ttft = res.ttft_ms || {};
      const tr = el("tr", { "data-run-id": String(run.id) });
      const statusCls = run.status === "done" ? "ok" : run.status === "failed" ? "bad" : "warn";
      const cells = [
        ["id", String(run.id), "num"],
        ["created_at", fmtWhen(run.created_at), "left"],
        ["dataset", p.dataset || DASH, "left"],
        ["params", `${fmtInt(p.num_prompts)} × ${fmtInt(p.max_concurrency)}`, "num"],
        ["status", run.status || DASH, `left state-${statusCls}`],
        ["completed", fmtInt(res.completed), "num"],
        ["failed", fmtInt(res.failed), "num"],
        ["hit_rate", fmtPct(res.hit_rate), "num"],
        ["ttft_p50", fmtFixed(ttft.p50, 1), "num"],
        ["ttft_p99", fmtFixed(ttft.p99, 1), "num"],
        ["throughput_rps", fmtFixed(res.throughput_rps, 2), "num"],
        ["balance", fmtFixed(res.balance, 2), "num"],
      ];
      for (const [field, text, cls] of cells) tr.append(el("td", { "data-field": field, class: cls }, text));
      rows.push(tr);
      if (run.error) {
        const errRow = el("tr", { class: "run-error-row" });
        errRow.append(el("td", { colspan: "12" }, `run #${run.id}: ${run.error}`));
        rows.push(errRow);
      }
    }
    tbody.replaceChildren(...rows);
  }

  function csrfToken() {
    const input = document.querySelector("#bench-form input[name=csrfmiddlewaretoken]");
    if (input && input.value) return input.value;
    const m = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
    return m ? decodeURIComponent(m[1]) : "";
  }

  function benchMessage(text, isError) {
    const node = $("#bench-message");
    setText(node, text);
    node.className = isError ? "error" : "muted";
  }

  async function onBenchSubmit(ev) {
    ev.preventDefault(); // the form keeps its values so a run is easy to repeat
    const body = {
      dataset: $("#bench-dataset").value,
      num_prompts: parseInt($("#bench-num-prompts").value, 10),
      max_concurrency: parseInt($("#bench-max-concurrency").value, 10),
    };
    const button = $("#bench-submit");
    button.disabled = true;
    benchMessage("submitting…", false);
    try {
      const resp = await fetch("/dashboard/bench", {
        method: "POST",
        credentials: "same-origin",
        headers: { "X-CSRFToken": csrfToken(), "Content-Type": "application/json", Accept: "application/json" },
        body: JSON.stringify(body),
      });
      let payload = null;
      try {
        payload = await resp.json();
      } catch (_) {
        payload = null; // e.g. an HTML 403 page or a redirect to the login form
      }
      if (!resp.ok || !payload || payload.error) {
        const msg = (payload && payload.error && payload.error.message)
          || (resp.redirected ? "session expired — log in again" : `request failed (HTTP ${resp.status})`);
        benchMessage(msg, true);
        flash(`benchmark: ${msg}`);
        return;
      }
      const id = payload.id ?? (payload.run && payload.run.id);
      benchMessage(id != null ? `queued run #${id}` : "queued", false);
    } catch (err) {
      benchMessage(`network error: ${err.message || err}`, true);
      flash(`benchmark: network error: ${err.message || err}`);
    } finally {
      button.disabled = false;
    }
  }

  // ---------------------------------------------------------------- snapshot

  /** Render one snapshot. Each section is isolated so one bad field cannot stop the others. */
  function renderMisses(snap) {
    // Why prompts missed the cache: tokens per rank and reason, then the diverging sessions.
    const m = snap.misses;
    if (!m) return;
    const key = JSON.stringify([m.targets, m.divergences, m.worst_sessions]);
    if (key === state.missesKey) return;
    state.missesKey = key;
    const reasons = m.reasons || [];
    const head = $("#miss-reasons-head");
    if (head.children.length !== reasons.length + 1) {
      head.replaceChildren(el("th", { class: "left" }, "rank"),
        ...reasons.map((r) => el("th", {}, r.replace(/_/g, " "))));
    }
    const rows = Object.keys(m.targets || {}).sort().map((target) => {
      const tr = el("tr", { "data-target": target });
      tr.append(el("td", { class: "left" }, target));
      for (const r of reasons) {
        tr.append(el("td", { class: "num", "data-reason": r }, fmtInt(m.targets[target][r] || 0)));
      }
      return tr;
    });
    if (rows.length) $("#miss-reasons tbody").replaceChildren(...rows);
    const divergences = (m.divergences || []).map((d) => {
      const tr = el("tr", { "data-session": d.session });
      const text = (part, field) => (d[part] ? d[part][field] : DASH);
      for (const [v, cls] of [[d.session, "left"], [fmtInt(d.token), "num"],
        [fmtInt(d.tokens), "num"], [d.target, "left"], [text("previous", "before"), "left mono"],
        [text("previous", "from"), "left mono"], [text("current", "from"), "left mono"]]) {
        tr.append(el("td", { class: cls }, v));
      }
      return tr;
    });
    if (divergences.length) $("#divergences tbody").replaceChildren(...divergences);
    const worst = (m.worst_sessions || []).map((w) => `${w.session} (${fmtInt(w.tokens)} tokens)`);
    setText($("#worst-sessions"), worst.length ? `diverging most: ${worst.join(", ")}` : "");
  }

  function renderSnapshot(snap) {
    window.dashboardSnapshots = (window.dashboardSnapshots || 0) + 1;
    window.lastSnapshot = snap;

    const at = isNum(snap.at) ? new Date(snap.at * 1000) : new Date();
    setText($("#updated"), `updated ${fmtClock(at)}`);

    const runs = Array.isArray(snap.bench) ? snap.bench : [];
    const sections = [
      ["fleet", () => renderFleet(snap)],
      ["policy", () => renderPolicy(snap)],
      ["ranks", () => renderRanks(snap)],
      ["bench table", () => renderBenchTable(runs)],
      ["miss reasons", () => renderMisses(snap)],
    ];
    if (haveUPlot()) {
      sections.push(
        ["hit-rate chart", () => renderHitChart(snap)],
        ["requests/s chart", () => renderRpsChart(snap)],
        ["bench chart", () => renderBenchChart(runs)],
      );
    }
    for (const [name, fn] of sections) {
      try {
        fn();
      } catch (err) {
        console.error(`dashboard: rendering ${name} failed`, err);
      }
    }
  }

  // ---------------------------------------------------------------- websocket

  function send(obj) {
    if (!state.ws || state.ws.readyState !== WebSocket.OPEN) return false;
    state.ws.send(JSON.stringify(obj));
    return true;
  }

  function onMessage(ev) {
    let msg;
    try {
      msg = JSON.parse(ev.data);
    } catch (_) {
      console.warn("dashboard: ignoring a non-JSON message");
      return;
    }
    if (!msg || typeof msg !== "object") return;
    if (msg.type === "snapshot") {
      renderSnapshot(msg);
    } else if (msg.type === "error") {
      flash(msg.message || "error");
      // A refused policy change: show the server's policy again.
      if (state.pendingPolicy) {
        state.pendingPolicy = null;
        if (window.lastSnapshot) renderPolicy(window.lastSnapshot);
      }
    }
  }

  function connect(path) {
    state.reconnectTimer = null;
    const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + path;
    let ws;
    try {
      ws = new WebSocket(url);
    } catch (err) {
      scheduleReconnect(path);
      return;
    }
    state.ws = ws;
    ws.addEventListener("open", () => {
      state.backoffMs = BACKOFF_MIN_MS;
      setConn("live", "live");
    });
    ws.addEventListener("message", onMessage);
    ws.addEventListener("close", (ev) => {
      if (state.ws === ws) state.ws = null;
      if (ev.code === CLOSE_NOT_AUTHORIZED) {
        state.stopped = true;
        setConn("not authorized — log in again", "denied");
        return;
      }
      scheduleReconnect(path);
    });
    // "error" is always followed by "close", which does the reconnecting.
  }

  function scheduleReconnect(path) {
    if (state.stopped || state.reconnectTimer) return;
    setConn("reconnecting…", "reconnecting");
    const delay = state.backoffMs;
    state.backoffMs = Math.min(state.backoffMs * 2, BACKOFF_MAX_MS);
    state.reconnectTimer = setTimeout(() => connect(path), delay);
  }

  // ---------------------------------------------------------------- start

  function init() {
    window.dashboardSnapshots = window.dashboardSnapshots || 0;
    $("#policy-select").addEventListener("change", onPolicyChange);
    $("#bench-form").addEventListener("submit", onBenchSubmit);
    $("#flash-close").addEventListener("click", () => { $("#flash-bar").hidden = true; });

    const path = document.body.dataset.wsPath;
    if (path) {
      connect(path);
    } else {
      setConn("offline (no websocket path)", "reconnecting"); // e.g. a static preview page
    }
  }

  window.renderSnapshot = renderSnapshot;
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
