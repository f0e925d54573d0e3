// kvscope dashboard: polls /stats, /requests and /health; lists the live requests with
// their tokens/s and a cancel button each (DELETE /requests/{id}); draws the KV cache
// over time (blocks against seconds ago) with a marker at each cancel, so a cancelled
// request's memory is seen dropping.
//
// Tokens/s: each request's rate is measured over the last RATE_WINDOW_S seconds of its
// own samples, and the tile is the sum of those rates, so the two agree. (The rows used
// to be lifetime averages, tokens / age, which keep a request's fast start long after
// it slowed (longer contexts, a busy machine): they summed to 343 while the requests
// made 82 tokens/s.
// The tile was a counter's change over one 500 ms poll, from two endpoints read at
// different moments and timed on arrival: it jumped between ~0 and several times the
// real rate. Polls also overlapped, so answers could be read out of order.)
"use strict";

const POLL_MS = 500;
const CHART_SECONDS = 60;                // the chart's time span
const RATE_WINDOW_S = 3;                 // tokens/s is measured over this window
const history = [];                      // {t, inUse, cached, total, tps}, t in seconds
const cancels = [];                      // {t, count, before, after}: cancels seen at t
const tokenSamples = new Map();          // request id -> [{t, tokens}] over the window
let lastCancelled = null;                // stats.cancelled at the previous poll
window.__dashboardErrors = [];           // read by the tests
window.__dashboardPolls = 0;             // polls rendered, read by the tests
window.addEventListener("error", (e) => window.__dashboardErrors.push(String(e.message)));
window.addEventListener("unhandledrejection", (e) => window.__dashboardErrors.push(String(e.reason)));

const $ = (id) => document.getElementById(id);
const keyInput = $("key");
keyInput.value = localStorage.getItem("kvscope-key") || "";
keyInput.addEventListener("change", () => localStorage.setItem("kvscope-key", keyInput.value));
const seconds = () => performance.now() / 1000;

async function api(path, options = {}) {
  const headers = {};
  if (keyInput.value) headers.Authorization = "Bearer " + keyInput.value;
  const response = await fetch(path, { ...options, headers });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    const message = (body.error && body.error.message) || response.statusText;
    throw new Error(`${options.method || "GET"} ${path}: ${response.status} ${message}`);
  }
  return body;
}

async function cancel(id, button) {
  button.disabled = true;
  try {
    await api(`/requests/${encodeURIComponent(id)}`, { method: "DELETE" });
  } catch (error) {
    showError(error);
  }
  poll();  // at once, so the cancel is marked where its blocks drop
}

function showError(error) { $("error").textContent = error ? String(error.message || error) : ""; }

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

// Each live request's tokens/s over the last RATE_WINDOW_S seconds (null until it has
// been seen twice); forgets the requests that are gone.
function requestRates(requests, t) {
  const rates = new Map();
  for (const r of requests) {
    const samples = tokenSamples.get(r.id) || [];
    samples.push({ t, tokens: r.tokens_generated });
    while (samples.length > 1 && t - samples[1].t >= RATE_WINDOW_S) samples.shift();
    tokenSamples.set(r.id, samples);
    const first = samples[0];
    rates.set(r.id, t > first.t ? Math.max(0, r.tokens_generated - first.tokens) / (t - first.t) : null);
  }
  for (const id of tokenSamples.keys()) if (!rates.has(id)) tokenSamples.delete(id);
  return rates;
}

function renderRequests(requests, rates) {
  const body = document.querySelector("#requests tbody");
  body.replaceChildren();
  for (const r of requests) {
    const row = body.insertRow();
    row.dataset.id = r.id;
    cell(row, r.id, "id");
    cell(row, r.status, "status");
    cell(row, r.priority);
    cell(row, r.prompt_tokens);
    cell(row, r.tokens_generated, "generated");
    const rate = rates.get(r.id);
    cell(row, rate === null ? "–" : rate.toFixed(1), "rate");
    cell(row, r.parent ? r.parent.slice(0, 12) + "…" : "");
    cell(row, r.text.slice(-60), "text");
    const button = document.createElement("button");
    button.className = "cancel";
    button.textContent = "cancel";
    button.dataset.cancel = r.id;
    button.addEventListener("click", () => cancel(r.id, button));
    row.insertCell().append(button);
  }
  $("live-count").textContent = `(${requests.length})`;
  $("empty").hidden = requests.length > 0;
}

function renderStats(stats, tps, t) {
  const total = stats.kv_blocks_total;
  $("kv-in-use").textContent = `${stats.kv_blocks_in_use} / ${total}`;
  $("kv-detail").textContent = `${stats.kv_blocks_free} free, ${stats.kv_blocks_cached} cached`;
  $("queue").textContent = `${stats.running} / ${stats.waiting}`;
  $("counts").textContent = `${stats.finished} finished, ${stats.cancelled} cancelled, ${stats.failed} failed`;
  $("tps").textContent = tps.toFixed(1);
  // A cancel is marked at the first sample that counts it; that /stats snapshot shows
  // its blocks back in the pool (or the next one, if the running step held them).
  if (lastCancelled !== null && stats.cancelled > lastCancelled && history.length) {
    const before = history[history.length - 1].inUse;
    cancels.push({ t, count: stats.cancelled - lastCancelled, before, after: stats.kv_blocks_in_use });
  }
  lastCancelled = stats.cancelled;
  history.push({ t, inUse: stats.kv_blocks_in_use, cached: stats.kv_blocks_cached, total, tps });
  while (history.length > 1 && t - history[1].t > CHART_SECONDS) history.shift();
  while (cancels.length && t - cancels[0].t > CHART_SECONDS) cancels.shift();
  drawChart(t);
}

// -- the chart: an SVG, so its axes and markers are part of the page ----------------------

const SVG = "http://www.w3.org/2000/svg";
const CHART = { w: 900, h: 220, left: 64, right: 64, top: 16, bottom: 42 };

function el(parent, name, attrs, text) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  parent.append(node);
  return node;
}

// The smallest 1, 2 or 5 times a power of ten that is >= value.
function niceCeil(value) {
  const power = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 5, 10].map((m) => m * power).find((v) => v >= value);
}

function drawChart(now) {
  const svg = $("kv-chart");
  svg.replaceChildren();
  const { w, h, left, right, top, bottom } = CHART;
  const plotW = w - left - right, plotH = h - top - bottom;
  const total = history.length ? history[history.length - 1].total : 0;
  const maxBlocks = niceCeil(Math.max(4, ...history.map((s) => Math.max(s.inUse, s.cached))));
  const maxTps = niceCeil(Math.max(1, ...history.map((s) => s.tps)));
  const x = (t) => left + plotW * (1 - Math.min(CHART_SECONDS, now - t) / CHART_SECONDS);
  const yBlocks = (v) => top + plotH * (1 - v / maxBlocks);
  const yTps = (v) => top + plotH * (1 - v / maxTps);

  for (let i = 0; i <= 4; i++) {
    const y = top + (plotH * i) / 4;
    el(svg, "line", { x1: left, x2: left + plotW, y1: y, y2: y, class: "grid" });
    el(svg, "text", { x: left - 6, y: y + 4, class: "tick blocks", "text-anchor": "end" },
      String((maxBlocks * (4 - i)) / 4));
    el(svg, "text", { x: left + plotW + 6, y: y + 4, class: "tick tps", "text-anchor": "start" },
      String((maxTps * (4 - i)) / 4));
  }
  for (let ago = CHART_SECONDS; ago >= 0; ago -= 10) {
    const xx = left + plotW * (1 - ago / CHART_SECONDS);
    el(svg, "line", { x1: xx, x2: xx, y1: top + plotH, y2: top + plotH + 4, class: "axis" });
    el(svg, "text", { x: xx, y: top + plotH + 16, class: "tick time", "text-anchor": "middle" },
      String(ago));
  }
  el(svg, "line", { x1: left, x2: left, y1: top, y2: top + plotH, class: "axis" });
  el(svg, "line", { x1: left, x2: left + plotW, y1: top + plotH, y2: top + plotH, class: "axis" });
  el(svg, "text", { x: left + plotW / 2, y: h - 6, class: "axis-title time", "text-anchor": "middle" },
    "seconds ago");
  const yMid = top + plotH / 2;
  el(svg, "text", { x: 14, y: yMid, class: "axis-title blocks", "text-anchor": "middle",
    transform: `rotate(-90 14 ${yMid})` }, total ? `KV blocks (of ${total})` : "KV blocks");
  el(svg, "text", { x: w - 10, y: yMid, class: "axis-title tps", "text-anchor": "middle",
    transform: `rotate(90 ${w - 10} ${yMid})` }, "tokens/s");

  // KV blocks are drawn as steps: a sample's value holds until the next poll, so a
  // drop shows at the sample that saw it, where its cancel marker is.
  const steps = (value, y) => history.map((s, i) => {
    const point = `${x(s.t).toFixed(1)},${y(value(s)).toFixed(1)}`;
    return i === 0 ? `M${point}` : `H${x(s.t).toFixed(1)}V${y(value(s)).toFixed(1)}`;
  }).join("");
  if (history.length) {
    const last = x(history[history.length - 1].t).toFixed(1);
    const inUse = steps((s) => s.inUse, yBlocks);
    el(svg, "path", { d: `${inUse}V${top + plotH}H${x(history[0].t).toFixed(1)}Z`, class: "area in-use" });
    el(svg, "path", { d: steps((s) => s.cached, yBlocks), class: "series cached" });
    el(svg, "path", { d: inUse, class: "series in-use" });
    const tps = history.map((s, i) => `${i ? "L" : "M"}${x(s.t).toFixed(1)},${yTps(s.tps).toFixed(1)}`);
    el(svg, "path", { d: tps.join(""), class: "series tps" });
    el(svg, "line", { x1: last, x2: last, y1: top, y2: top + plotH, class: "now" });
  }
  for (const c of cancels) {
    const g = el(svg, "g", {
      class: "cancel-marker", "data-count": c.count, "data-before": c.before, "data-after": c.after,
    });
    const xx = x(c.t);
    el(g, "line", { x1: xx, x2: xx, y1: top, y2: top + plotH });
    el(g, "text", { x: xx - 3, y: top + 10, "text-anchor": "end" }, c.count > 1 ? `✕${c.count}` : "✕");
    el(g, "title", {}, `${c.count} cancelled ${(now - c.t).toFixed(0)} s ago: ` +
      `KV blocks in use ${c.before} → ${c.after}`);
  }
}

// -- polling: one poll at a time, so answers are never read out of order -----------------

let timer = null;
let polling = false;
let again = false;

async function poll() {
  if (polling) { again = true; return; }
  polling = true;
  clearTimeout(timer);
  try {
    const [stats, list] = await Promise.all([api("/stats"), api("/requests")]);
    const t = seconds();
    const rates = requestRates(list.requests, t);
    const tps = [...rates.values()].reduce((sum, rate) => sum + (rate || 0), 0);
    renderStats(stats, tps, t);
    renderRequests(list.requests, rates);
    showError(null);
    window.__dashboardPolls += 1;
  } catch (error) {
    showError(error);
  }
  try {
    const health = await fetch("/health").then((r) => r.json());
    $("model").textContent = `model ${health.model}`;
    $("health").textContent = health.status;
    $("health").className = "pill " + (health.ready ? "ok" : "down");
  } catch (error) {
    $("health").textContent = "unreachable";
    $("health").className = "pill down";
  }
  polling = false;
  timer = setTimeout(poll, again ? 0 : POLL_MS);
  again = false;
}

poll();
