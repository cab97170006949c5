// The live dashboard's logic, served at /dashboard.js: the page's Content-Security-Policy runs
// scripts from this origin only, never inline ones. Self-contained: no chart library, no network
// access beyond this API.
//
// Every value from the API reaches the page through textContent or setAttribute on elements built
// here with createElement: strings read from Redis (instance ids, states, the run name) are never
// parsed as HTML, so one holding markup shows as that text.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];
const CHARTS = [
  {id: "eval", title: "Eval accuracy (avg@k)", series: [["eval/acc", "eval acc"]], sparse: true},
  {id: "reward", title: "Mean reward (training samples)", series: [["critic/rewards/mean", "reward"], ["rollout/acc_mean", "acc"]]},
  {id: "length", title: "Response length (tokens)", series: [["response_length/mean", "mean"], ["response_length/max", "max"]]},
  {id: "entropy", title: "Entropy", series: [["actor/entropy", "entropy"]]},
  {id: "clip", title: "Clip fractions", series: [["actor/clipfrac_high", "upper (clip-higher)"], ["actor/clipfrac_low", "lower"], ["actor/clipfrac_lower", "dual clip"]]},
  {id: "pass", title: "Gatekeeper pass rate", series: [["gate/pass_rate", "pass rate"]]},
  {id: "depth", title: "Stream depths", series: [["depth/rollout", "prompts"], ["depth/reward", "rollouts"], ["depth/gatekeeper", "scored"], ["depth/learner", "train"]]},
  {id: "throughput", title: "Throughput (response tokens/s)", series: [["throughput/tokens_per_s", "tokens/s"]]},
  {id: "lag", title: "Policy-version lag of trained samples", series: [["rollout/version_lag_mean", "mean lag"]]},
];
const fixed3 = v => (Number.isFinite(v) ? v.toFixed(3) : "-");
// One row per task (data_source) from /status `tasks` (issue 42): the run's figures so far.
const TASK_COLUMNS = [
  ["task", ([name]) => name], ["accuracy", ([, t]) => fixed3(t.accuracy)],
  ["pass rate", ([, t]) => fixed3(t.pass_rate)],
  ["response length", ([, t]) => (Number.isFinite(t.response_length) ? t.response_length.toFixed(1) : "-")],
  ["base eval", ([, t]) => fixed3(t.base_eval_acc)], ["last eval", ([, t]) => fixed3(t.eval_acc)],
  ["groups", ([, t]) => t.kept + t.filtered],
];
const INSTANCE_COLUMNS = [
  ["role", i => i.role], ["id", i => i.id], ["host", i => i.host], ["pid", i => i.pid],
  ["policy version", i => i.policy_version], ["heartbeat age (s)", i => i.heartbeat_age_s],
];

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function htmlEl(tag, text, className) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = String(text ?? "-");
  if (className) e.className = className;
  return e;
}

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

function setup() {
  const root = document.getElementById("charts");
  for (const c of CHARTS) {
    const card = htmlEl("div", undefined, "card");
    card.appendChild(htmlEl("h2", c.title));
    card.appendChild(svgEl("svg", {id: `chart-${c.id}`, "data-chart": c.id, viewBox: "0 0 400 170", preserveAspectRatio: "none"}));
    const legend = htmlEl("div", undefined, "legend");
    c.series.forEach(([, label], i) => {
      const span = htmlEl("span", label);
      span.style.setProperty("--c", COLORS[i]);  // CSSOM, not a style attribute: the CSP allows it
      legend.appendChild(span);
    });
    card.appendChild(legend);
    root.appendChild(card);
  }
}

function draw(chart, rows) {
  const svg = document.getElementById(`chart-${chart.id}`);
  svg.replaceChildren();
  const W = 400, H = 170, L = 50, B = 18, T = 6, R = 6;
  const lines = chart.series.map(([key]) => rows.filter(r => Number.isFinite(r[key])).map(r => [r.step, r[key]]));
  const pts = lines.flat();
  svg.dataset.points = String(pts.length);
  if (!pts.length) { svg.appendChild(svgEl("text", {x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#999"}, "no data yet")); return; }
  let [x0, x1] = [Math.min(...pts.map(p => p[0])), Math.max(...pts.map(p => p[0]))];
  let [y0, y1] = [Math.min(...pts.map(p => p[1])), Math.max(...pts.map(p => p[1]))];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = y => H - B - (y - y0) / (y1 - y0) * (H - B - T);
  for (const f of [0, 0.5, 1]) {
    const y = y0 + f * (y1 - y0);
    svg.appendChild(svgEl("line", {x1: L, x2: W - R, y1: sy(y), y2: sy(y), stroke: "#eee"}));
    svg.appendChild(svgEl("text", {x: L - 4, y: sy(y) + 4, "text-anchor": "end", "font-size": 10, fill: "#667"}, +y.toPrecision(3)));
  }
  svg.appendChild(svgEl("text", {x: L, y: H - 4, "font-size": 10, fill: "#667"}, `step ${x0}`));
  svg.appendChild(svgEl("text", {x: W - R, y: H - 4, "text-anchor": "end", "font-size": 10, fill: "#667"}, `step ${x1}`));
  lines.forEach((line, i) => {
    if (!line.length) return;
    const d = line.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    svg.appendChild(svgEl("path", {d, fill: "none", stroke: COLORS[i], "stroke-width": 1.6, class: "series"}));
    if (chart.sparse || line.length < 30) for (const p of line) svg.appendChild(svgEl("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2.2, fill: COLORS[i]}));
  });
}

function withDerived(rows, status) {
  // Per-step throughput from consecutive records; eval points include the start-of-run eval.
  // Records without a numeric step cannot be placed on a chart and are left out.
  const stepped = rows.filter(r => r && Number.isFinite(r.step));
  const out = stepped.map((r, i) => {
    const o = {...r};
    const prev = stepped[i - 1];
    if (prev && r.time > prev.time) o["throughput/tokens_per_s"] = (r["rollout/tokens"] || 0) / (r.time - prev.time);
    return o;
  });
  for (const [step, acc] of status.eval_history || []) {
    if (!out.some(r => r.step === step && Number.isFinite(r["eval/acc"]))) out.push({step, "eval/acc": acc});
  }
  return out.sort((a, b) => a.step - b.step);
}

function ledgerText(l) {
  if (!l) return "unreadable (malformed in Redis)";
  return `issued ${l.issued} = trained ${l.trained} + filtered ${l.filtered} + stale ${l.stale} + dead ${l.dead} + in flight ${l.in_flight}` + (l.balanced ? " ✓" : " ✗");
}

function generationText(g) {
  const ratio = g.generated_per_trained == null ? "-" : g.generated_per_trained.toFixed(2);
  return `${ratio} groups per group trained, ${g.prompts_skipped} prompts skipped`;
}

function redisText(m) {
  const mib = b => (b / 1048576).toFixed(1);
  return `${mib(m.used_bytes)} MiB` + (m.maxmemory_bytes ? ` of ${mib(m.maxmemory_bytes)}` : "") + (m.at_maxmemory ? " (FULL: services paused)" : "");
}

function skippedText(skipped) {
  const parts = Object.entries(skipped || {}).map(([source, n]) => `${source} ${n}`);
  return parts.length ? parts.join(", ") : "none";
}

function drawTable(id, columns, items) {
  const header = document.createElement("tr");
  for (const [title] of columns) header.appendChild(htmlEl("th", title));
  const rows = items.map(item => {
    const tr = document.createElement("tr");
    for (const [, value] of columns) tr.appendChild(htmlEl("td", value(item)));
    return tr;
  });
  document.getElementById(id).replaceChildren(header, ...rows);
}

async function getJson(path) {
  const r = await fetch(path);
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

async function refresh() {
  try {
    const [status, history] = await Promise.all([getJson("status"), getJson("metrics/history")]);
    setText("run", `DAPO · ${status.run_name}`);
    setText("step", status.step);
    setText("version", status.policy_version ?? "-");
    setText("state", status.learner_state + (status.paused ? " (paused)" : ""));
    setText("ledger", ledgerText(status.ledger));
    setText("generation", generationText(status.generation));
    setText("redis", redisText(status.redis_memory));
    setText("skipped", skippedText(status.skipped_values));
    setText("updated", new Date().toLocaleTimeString());
    const rows = withDerived(history, status);
    for (const c of CHARTS) draw(c, rows);
    drawTable("instances", INSTANCE_COLUMNS, status.instances);
    drawTable("tasks", TASK_COLUMNS, Object.entries(status.tasks || {}));
    setText("error", "");
    document.body.dataset.loaded = "1";
  } catch (e) {
    setText("error", `cannot reach the API: ${e}`);
  }
}

setup();
refresh();
setInterval(refresh, 3000);
