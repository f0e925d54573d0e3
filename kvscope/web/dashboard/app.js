// kvscope dashboard: polls /stats, /requests and /health; draws KV usage and tokens/s
// over time; lists the live requests with a cancel button each (DELETE /requests/{id}).
"use strict";

const POLL_MS = 500;
const HISTORY = 240;                     // samples kept for the chart (2 minutes)
const history = [];                      // {t, inUse, cached, total, tps}
let lastTokens = null;                   // {t, total} for tokens/s
window.__dashboardErrors = [];           // read by the tests
window.addEventListener("error", (e) => window.__dashboardErrors.push(String(e.message)));

const $ = (id) => document.getElementById(id);
const keyInput = $("key");
keyInput.value = localStorage.getItem("kvscope-key") || "";
keyInput.addEventListener("change", () => localStorage.setItem("kvscope-key", keyInput.value));

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
  refresh();
}

function showError(error) { $("error").textContent = error ? String(error.message || error) : ""; }

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function renderRequests(requests) {
  const body = document.querySelector("#requests tbody");
  body.replaceChildren();
  const now = Date.now() / 1000;
  for (const r of requests) {
    const row = body.insertRow();
    row.dataset.id = r.id;
    cell(row, r.id, "id");
    cell(row, r.status, "status");
    cell(row, r.priority);
    cell(row, r.prompt_tokens);
    cell(row, r.tokens_generated, "generated");
    const age = Math.max(1e-3, now - r.created);
    cell(row, (r.tokens_generated / age).toFixed(1));
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

function renderStats(stats, requests) {
  const total = stats.kv_blocks_total;
  $("kv-in-use").textContent = `${stats.kv_blocks_in_use} / ${total}`;
  $("kv-detail").textContent = `${stats.kv_blocks_free} free, ${stats.kv_blocks_cached} cached`;
  $("queue").textContent = `${stats.running} / ${stats.waiting}`;
  $("counts").textContent = `${stats.finished} finished, ${stats.cancelled} cancelled, ${stats.failed} failed`;
  const now = performance.now() / 1000;
  const tokens = stats.tokens_generated_total + requests.reduce((sum, r) => sum + r.tokens_generated, 0);
  let tps = 0;
  if (lastTokens && now > lastTokens.t) tps = Math.max(0, (tokens - lastTokens.total) / (now - lastTokens.t));
  lastTokens = { t: now, total: tokens };
  $("tps").textContent = tps.toFixed(1);
  history.push({ inUse: stats.kv_blocks_in_use, cached: stats.kv_blocks_cached, total, tps });
  if (history.length > HISTORY) history.shift();
  drawChart();
}

function drawChart() {
  const canvas = $("kv-chart");
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  if (history.length < 2) return;
  const x = (i) => (i / (HISTORY - 1)) * w;
  const maxTps = Math.max(1, ...history.map((s) => s.tps));
  const line = (value, color) => {
    ctx.beginPath();
    history.forEach((s, i) => {
      const y = h - 4 - value(s) * (h - 8);
      if (i === 0) ctx.moveTo(x(i), y); else ctx.lineTo(x(i), y);
    });
    ctx.strokeStyle = color;
    ctx.lineWidth = 2;
    ctx.stroke();
  };
  line((s) => s.cached / Math.max(1, s.total), "#90a4ae");
  line((s) => s.inUse / Math.max(1, s.total), "#1565c0");
  line((s) => s.tps / maxTps, "#ef6c00");
}

async function refresh() {
  try {
    const [stats, list] = await Promise.all([api("/stats"), api("/requests")]);
    renderStats(stats, list.requests);
    renderRequests(list.requests);
    showError(null);
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
}

refresh();
setInterval(refresh, POLL_MS);
