// strata's live dashboard: `/stats/stream` (once a second) drawn as cards, a layer x
// expert map of where every routed expert is, and hit rates over time.

import { api, errorText } from "./api.js";
import { sseData } from "./sse.js";

const $ = (id) => document.getElementById(id);
const COLORS = { g: [59, 111, 224], h: [47, 158, 90], d: [138, 138, 138], r: [201, 162, 39] };
const TIER = { g: "GPU slab", h: "host slab", d: "disk", r: "resident" };
const HISTORY = 120;

const state = { prev: null, history: [], residency: null, topics: null, layout: null };

function fmtBytes(n) {
  if (n == null) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}

function pct(x) {
  return x == null || !Number.isFinite(x) ? "–" : `${(100 * x).toFixed(1)}%`;
}

function rate(num, den) {
  return den > 0 ? num / den : null;
}

// ---- the map

function drawMap() {
  const r = state.residency;
  const canvas = $("map");
  if (!r) {
    canvas.height = 40;
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    $("map-summary").textContent = "This model has no routed experts.";
    return;
  }
  const rows = r.layers.length, cols = r.experts_per_layer;
  const width = canvas.clientWidth || 800;
  const cell = Math.max(2, Math.min(14, Math.floor(width / cols)));
  canvas.width = cell * cols;
  canvas.height = cell * rows;
  canvas.style.height = `${cell * rows}px`;
  canvas.style.width = `${cell * cols}px`;
  state.layout = { cell, rows, cols };
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  let max = 1;
  if (r.counts) for (const row of r.counts) for (const c of row) max = Math.max(max, c);
  const tally = { g: 0, h: 0, d: 0, r: 0, pinned: 0 };
  for (let y = 0; y < rows; y++) {
    const tiers = r.tiers[y];
    for (let x = 0; x < cols; x++) {
      const code = tiers[x];
      const t = code.toLowerCase();
      tally[t]++;
      const heat = r.counts ? Math.log1p(r.counts[y][x]) / Math.log1p(max) : 1;
      const [cr, cg, cb] = COLORS[t];
      ctx.fillStyle = `rgba(${cr},${cg},${cb},${(0.25 + 0.75 * heat).toFixed(3)})`;
      ctx.fillRect(x * cell, y * cell, cell - (cell > 3 ? 1 : 0), cell - (cell > 3 ? 1 : 0));
      if (code !== t) {
        tally.pinned++;
        ctx.strokeStyle = "#000";
        ctx.lineWidth = 1;
        ctx.strokeRect(x * cell + 0.5, y * cell + 0.5, cell - 2, cell - 2);
      }
    }
  }
  const n = rows * cols;
  const parts = [["g", "on the GPU"], ["h", "in host memory"], ["d", "on disk only"], ["r", "resident"]]
    .filter(([t]) => tally[t]).map(([t, w]) => `${tally[t]} ${w}`);
  const summary = `${n} experts in ${rows} layers: ${parts.join(", ")}${tally.pinned ? `; ${tally.pinned} pinned` : ""}.`;
  $("map-summary").textContent = summary;
  canvas.setAttribute("aria-description", summary);
}

function tooltip(e) {
  const r = state.residency, L = state.layout, tip = $("tip");
  if (!r || !L) return;
  const box = $("map").getBoundingClientRect();
  const x = Math.floor((e.clientX - box.left) / L.cell), y = Math.floor((e.clientY - box.top) / L.cell);
  if (x < 0 || y < 0 || x >= L.cols || y >= L.rows) { tip.hidden = true; return; }
  const code = r.tiers[y][x];
  const layer = r.layers[y];
  let text = `layer ${layer}, expert ${x}: ${TIER[code.toLowerCase()]}${code !== code.toLowerCase() ? " (pinned)" : ""}`;
  if (r.counts) text += `, ${r.counts[y][x]} selections`;
  const topic = state.topics && state.topics.get(`${layer}/${x}`);
  if (topic) text += `; atlas: ${topic[0]} (specialization ${topic[1].toFixed(2)})`;
  tip.textContent = text;
  tip.hidden = false;
  tip.style.left = `${Math.min(e.clientX - box.left + 12, box.width - 260)}px`;
  tip.style.top = `${e.clientY - box.top + 12}px`;
}

// ---- over time

function drawRates() {
  const canvas = $("rates");
  const w = (canvas.width = canvas.clientWidth || 800), h = canvas.height;
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, w, h);
  const hist = state.history;
  if (hist.length < 2) return;
  const maxTps = Math.max(1, ...hist.map((p) => p.tps || 0));
  const series = [["gpu", COLORS.g, 1], ["host", COLORS.h, 1], ["tps", COLORS.r, maxTps]];
  for (const [key, [r, g, b], scale] of series) {
    ctx.strokeStyle = `rgb(${r},${g},${b})`;
    ctx.lineWidth = 2;
    ctx.beginPath();
    let started = false;
    hist.forEach((p, i) => {
      const v = p[key];
      if (v == null) { started = false; return; }
      const px = (i / (HISTORY - 1)) * w, py = h - 4 - (v / scale) * (h - 8);
      if (started) ctx.lineTo(px, py); else { ctx.moveTo(px, py); started = true; }
    });
    ctx.stroke();
  }
  ctx.fillStyle = "#888";
  ctx.font = "11px sans-serif";
  ctx.fillText(`GPU hits (blue), host hits (green): 0-100%; tokens/s (gold): 0-${maxTps.toFixed(0)}`, 6, 12);
}

// ---- one message

function update(snap) {
  const now = performance.now();
  const s = snap.stats, t = snap.expert_totals, eng = s.engine || {};
  const prev = state.prev;
  const dt = prev ? (now - prev.at) / 1000 : 0;
  const point = { tps: null, gpu: null, host: null };
  if (prev && dt > 0) {
    // Decoded rows a second (each a token) while nothing drafts; with drafts, rows include
    // the verified guesses, and finished requests' tokens count instead.
    const pe = prev.s.engine || {};
    point.tps = eng.mtp_rounds || pe.decode_rows == null
      ? (s.totals.generated_tokens - prev.s.totals.generated_tokens) / dt
      : (eng.decode_rows - pe.decode_rows) / dt;
  }
  // The expert counters move at the runtime's turn boundary (every 2 s while busy): rates
  // over the span since they last moved, held in between.
  const looked = (x) => x.hits + x.misses + x.gpu_hits + x.gpu_misses;
  if (t && (!state.turn || looked(t) !== looked(state.turn.t))) {
    if (state.turn) {
      const o = state.turn.t, span = (now - state.turn.at) / 1000;
      state.rates = {
        host: rate(t.hits - o.hits, t.hits - o.hits + t.misses - o.misses),
        gpu: rate(t.gpu_hits - o.gpu_hits, t.gpu_hits - o.gpu_hits + t.gpu_misses - o.gpu_misses),
        read: (t.read_bytes[0] + t.read_bytes[1] - o.read_bytes[0] - o.read_bytes[1]) / span,
      };
    }
    state.turn = { at: now, t };
  }
  if (state.rates) {
    point.host = state.rates.host;
    point.gpu = state.rates.gpu;
    $("io").textContent = `${fmtBytes(state.rates.read)}/s`;
  }
  state.prev = { at: now, s, t };
  state.history.push(point);
  if (state.history.length > HISTORY) state.history.shift();

  $("model").textContent = `${s.model.id} (${s.model.model_type})`;
  $("tps").textContent = point.tps == null ? "–" : point.tps.toFixed(1);
  const last = s.last_generation;
  $("tps-note").textContent = last ? `last request: ${last.decode_tokens_per_s.toFixed(1)} tok/s decode` : "";
  $("requests").textContent = `${s.queue.active} running`;
  $("queue").textContent = `${s.queue.depth} waiting of ${s.queue.capacity}; batch ${s.queue.max_batch}`;
  if (eng.kv_total_blocks) {
    const used = eng.kv_total_blocks - eng.kv_free_blocks;
    $("kv").textContent = `${pct(used / eng.kv_total_blocks)} in use`;
    $("prompt-cache").textContent = `${used} of ${eng.kv_total_blocks} blocks; prompt cache ${eng.cache_blocks} blocks, ${eng.cache_hit_tokens} tokens reused`;
  }
  $("hits").textContent = point.gpu != null ? `GPU ${pct(point.gpu)}` : point.host != null ? pct(point.host) : "–";
  $("hits-note").textContent = t
    ? `since start: ${t.gpu_hits + t.gpu_misses ? `GPU ${pct(rate(t.gpu_hits, t.gpu_hits + t.gpu_misses))}, ` : ""}host ${pct(rate(t.hits, t.hits + t.misses))}`
    : "experts resident: nothing streams";
  const demand = s.experts && s.experts.turn && s.experts.turn.demand;
  if (demand && demand.disk_service && demand.disk_service.total_s > 0) {
    $("io-note").textContent = `the disk served ${fmtBytes(demand.read_bytes / demand.disk_service.total_s)}/s while reading (last turn)`;
  } else if (!t) {
    $("io").textContent = "–";
    $("io-note").textContent = "no expert reads";
  }
  if (eng.mtp_drafted) {
    $("mtp").textContent = pct(eng.mtp_accepted / eng.mtp_drafted);
    $("mtp-note").textContent = `${eng.mtp_accepted} of ${eng.mtp_drafted} drafts accepted`;
  } else {
    $("mtp").textContent = "–";
    $("mtp-note").textContent = "no drafts";
  }
  const body = $("plan").querySelector("tbody");
  body.replaceChildren();
  const row = (name, value, head) => {
    const tr = document.createElement("tr");
    const a = document.createElement(head ? "th" : "td"), b = document.createElement("td");
    if (head) a.scope = "row";
    a.textContent = name;
    b.textContent = value;
    tr.append(a, b);
    body.append(tr);
  };
  const plans = [["GPU", s.plan && s.plan.gpu_fit], ["host", s.plan && s.plan.fit]].filter(([, f]) => f && f.report);
  for (const [where, fit] of plans) {
    row(`${where} (${s.plan.device})`, "", true);
    for (const i of fit.report.items) row(i.name, fmtBytes(i.bytes));
    row("total / budget / headroom", `${fmtBytes(fit.report.total)} / ${fmtBytes(fit.report.budget)} / ${fmtBytes(fit.report.headroom)}`);
  }
  if (!plans.length) row(`weights loaded whole on ${s.plan ? s.plan.device : "?"} (no expert plan)`, "");
  state.residency = snap.residency;
  drawMap();
  drawRates();
  if (snap.atlas && !state.topics) loadTopics();
  $("atlas-link").hidden = !snap.atlas;
}

async function loadTopics() {
  state.topics = new Map();
  try {
    const r = await api("/stats/atlas");
    if (!r.ok) throw new Error(await errorText(r));
    for (const [layer, expert, topic, spec] of (await r.json()).experts) state.topics.set(`${layer}/${expert}`, [topic, spec]);
  } catch (e) {
    $("live").textContent = `atlas: ${e.message}`;
  }
}

async function connect() {
  for (;;) {
    try {
      const r = await api("/stats/stream");
      if (!r.ok) throw new Error(await errorText(r));
      $("live").textContent = "live";
      for await (const data of sseData(r)) update(JSON.parse(data));
      $("live").textContent = "the server closed the stream; reconnecting…";
    } catch (e) {
      $("live").textContent = `disconnected (${e.message}); retrying…`;
    }
    await new Promise((ok) => setTimeout(ok, 2000));
  }
}

$("map").addEventListener("mousemove", tooltip);
$("map").addEventListener("mouseleave", () => { $("tip").hidden = true; });
window.addEventListener("resize", () => { drawMap(); drawRates(); });
connect();
