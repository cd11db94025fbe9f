// The dashboard: the project's jobs, one job's curves, samples, events and checkpoints, from the public /v1 API.
// Every value from the API reaches the page as a text node or an attribute set through the DOM, never as
// HTML, so a completion containing <script> is shown, not run (the CSP forbids inline code as well).
"use strict";

const KEY_STORAGE = "cispo.apiKey";
const LIVE = new Set(["validating_files", "queued", "running", "paused"]);
const REFRESH_MS = 3000;
// Curves to draw: a title and the metric names worker/trainer/loop.py and metrics.py write, first found wins;
// `titles` names the curve after the metric found (kl_old is the KL to the rollout policy, not the reference);
// `band`: the metrics of each point's 95% interval (worker/evals/intervals.py), drawn as a bar through the point.
// `for`: which jobs draw it (a supervised job writes loss and eval_loss, and an eval reward only with a reward).
const RL = (job) => job.method.type !== "supervised";
const SCORED = (job) => RL(job) || Boolean(job.method.supervised &&
  (job.method.supervised.reward || job.method.supervised.reward_function));
const CHARTS = [
  { title: "Reward (mean)", names: ["reward_mean"], for: RL },
  { title: "Eval reward (greedy, held-out rows; bars: 95% interval)", names: ["eval_reward_mean"],
    band: ["eval_reward_ci_low", "eval_reward_ci_high"], for: SCORED },
  { title: "KL", names: ["kl_ref", "kl_old"], for: RL,
    titles: { kl_ref: "KL to the reference (kl_ref)", kl_old: "KL to the rollout policy (kl_old)" } },
  { title: "Clip fraction", names: ["clip_fraction"], for: RL },
  { title: "Loss", names: ["loss"], for: () => true },
  { title: "Eval loss (held-out conversations)", names: ["eval_loss"], for: (job) => !RL(job) },
];
const SVG_NS = "http://www.w3.org/2000/svg";

// The address's fragment: "#ftjob-..." (or "#job=ftjob-...") picks a job, "#key=sk-..." brings the API key, so a
// link opens the page ready. A fragment never reaches the server (no access log holds it); the key moves to
// localStorage at once and leaves the address bar and the history.
function fromFragment() {
  const found = { key: null, job: null };
  for (const part of location.hash.slice(1).split("&").filter(Boolean)) {
    const [name, ...rest] = part.split("=");
    if (rest.length && name === "key") found.key = decodeURIComponent(rest.join("="));
    else if (rest.length && name === "job") found.job = decodeURIComponent(rest.join("="));
    else if (!rest.length) found.job = decodeURIComponent(part);
  }
  return found;
}

const state = { jobId: fromFragment().job, timer: null };

// -- DOM helpers -------------------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

const $ = (id) => document.getElementById(id);
const when = (seconds) => (seconds ? new Date(seconds * 1000).toLocaleString() : "");
// 24-hour time: nothing to cut off in a narrow column, nothing ambiguous without AM/PM.
const short = (seconds) => new Date(seconds * 1000).toLocaleString([], { month: "short", day: "numeric",
  hour: "2-digit", minute: "2-digit", hourCycle: "h23" });
const number = (v) => (v === null || v === undefined ? "–" : Math.abs(v) >= 1000 || (v !== 0 && Math.abs(v) < 0.001)
  ? v.toExponential(2) : (+v.toFixed(4)).toString());

function showKeyState() {
  $("key").placeholder = localStorage.getItem(KEY_STORAGE)
    ? "a key is saved in this browser" : "paste your project's API key";
}

function takeKeyFromFragment(key, jobId) {
  localStorage.setItem(KEY_STORAGE, key);
  history.replaceState(null, "", jobId ? `#${jobId}` : location.pathname + location.search);
}

function notice(message, kind) {
  $("notice").textContent = message || "";
  $("notice").className = kind || "";
}

// -- API ---------------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, options = {}) {
  const key = localStorage.getItem(KEY_STORAGE);
  if (!key) throw new ApiError(401, "Enter your API key to see your project's jobs.");
  const response = await fetch(`/v1${path}`, {
    ...options, headers: { Authorization: `Bearer ${key}`, ...(options.headers || {}) },
  });
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try { message = (await response.json()).error.message || message; } catch (_) { /* not our envelope */ }
    throw new ApiError(response.status, message);
  }
  return options.raw ? response : response.json();
}

// -- jobs list ---------------------------------------------------------------------------------------

function progress(job) {
  const total = job.total_steps || 0;
  const bar = el("progress", { max: String(total || 1), value: String(job.steps_done || 0) });
  return el("span", { class: "progress" }, bar, ` ${job.steps_done}/${total}`);
}

function statusBadge(status) {
  return el("span", { class: `status status-${status}` }, status);
}

async function loadJobs() {
  const page = await api("/fine_tuning/jobs?limit=50");
  const body = $("jobs").querySelector("tbody");
  body.replaceChildren(...page.data.map((job) => {
    const row = el("tr", { "data-job": job.id, class: job.id === state.jobId ? "selected" : "" },
      el("td", {}, el("div", { class: "mono" }, job.id), el("div", { class: "muted small" }, job.model),
        job.fine_tuned_model ? el("div", { class: "small fine-tuned", title: job.fine_tuned_model }, job.fine_tuned_model)
          : job.user_provided_suffix ? el("div", { class: "small fine-tuned" }, `suffix ${job.user_provided_suffix}`)
            : ""),
      el("td", {}, statusBadge(job.status)), el("td", {}, progress(job)),
      el("td", { class: "small nowrap" }, short(job.created_at)));
    row.addEventListener("click", () => select(job.id));
    return row;
  }));
  $("jobs-empty").hidden = page.data.length > 0;
  return page.data;
}

// -- one job -----------------------------------------------------------------------------------------

function renderJob(job) {
  $("job").hidden = false;
  $("job-title").replaceChildren(el("span", { class: "mono" }, job.id), " ", statusBadge(job.status));
  const parts = [`model ${job.model}`, `step ${job.steps_done} of ${job.total_steps}`, `created ${when(job.created_at)}`];
  if (job.fine_tuned_model) parts.push(`fine-tuned model ${job.fine_tuned_model}`);
  const f = job.forecast;
  if (f && f.asymptote) {
    parts.push(`forecast: asymptote ${number(f.asymptote.mean)} (95% ${number(f.asymptote.interval[0])} to ` +
      `${number(f.asymptote.interval[1])}), ${number(f.predicted_final_reward)} at step ${f.final_step}` +
      (f.trustworthy ? "" : ` (not yet trustworthy: ${f.reason})`));
  } else if (f) {
    parts.push(`forecast: ${f.reason}`);
  }
  if (job.best_checkpoint) parts.push(`best checkpoint ${job.best_checkpoint}`);
  $("job-summary").textContent = parts.join(" · ");
  $("job-error").hidden = !job.error;
  $("job-error").textContent = job.error ? `${job.error.code}: ${job.error.message}` : "";
  $("pause").disabled = !["queued", "running"].includes(job.status);
  $("resume").disabled = job.status !== "paused";
  $("cancel").disabled = !LIVE.has(job.status);
}

// An axis label in at most 4 significant digits ("111.5", not "111.4895"): the left margin is sized to fit it.
const tick = (v) => (v === 0 || (Math.abs(v) >= 0.001 && Math.abs(v) < 10000)
  ? (+v.toPrecision(4)).toString() : v.toExponential(1));

function chart(title, name, points, band) {
  const W = 360, H = 180, R = 12, T = 24, B = 28;
  const finite = points.filter((p) => p.value !== null);
  const box = el("figure", { class: "chart", "data-metric": name || "" }, el("figcaption", {}, title,
    name ? el("span", { class: "muted" }, ` ${name}`) : ""));
  const plot = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title });
  if (!finite.length) {
    plot.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "no data yet"));
    box.append(plot);
    return box;
  }
  // band: step -> [low, high]; the axis spans the intervals too, so a bar is never cut off.
  const bars = finite.filter((p) => band && band[p.step] && band[p.step].every((v) => v !== null && v !== undefined));
  const steps = points.map((p) => p.step), values = finite.map((p) => p.value)
    .concat(...bars.map((p) => band[p.step]));
  const [first, last] = [Math.min(...steps), Math.max(...steps)];
  let [x0, x1, y0, y1] = [first, last, Math.min(...values), Math.max(...values)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
  const levels = [y0, (y0 + y1) / 2, y1];
  const L = 14 + 7 * Math.max(...levels.map((v) => tick(v).length)); // 11px digits are under 7px wide
  const x = (s) => L + ((s - x0) / (x1 - x0)) * (W - L - R);
  const y = (v) => T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
  for (const v of levels) {
    plot.append(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid" }),
      svg("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end", class: "tick" }, tick(v)));
  }
  plot.append(svg("text", { x: L, y: H - 8, class: "tick" }, `step ${first}`),
    svg("text", { x: W - R, y: H - 8, "text-anchor": "end", class: "tick" }, `step ${last}`));
  // A non-finite value (stored as null) breaks the line instead of being drawn as zero.
  let d = "", pen = "M";
  for (const p of points) {
    if (p.value === null) { pen = "M"; continue; }
    d += `${pen}${x(p.step).toFixed(1)},${y(p.value).toFixed(1)} `;
    pen = "L";
  }
  plot.append(svg("path", { d: d.trim(), class: "line", "data-points": String(finite.length) }));
  for (const p of bars) {
    const [low, high] = band[p.step];
    plot.append(svg("line", { x1: x(p.step), x2: x(p.step), y1: y(low), y2: y(high), class: "interval",
      "data-step": String(p.step) }, svg("title", {}, `step ${p.step}: 95% interval ${number(low)} to ${number(high)}`)));
  }
  for (const p of finite) {
    plot.append(svg("circle", { cx: x(p.step), cy: y(p.value), r: 2.5, class: "dot" },
      svg("title", {}, `step ${p.step}: ${p.value}`)));
  }
  box.append(plot);
  return box;
}

async function loadCharts(job) {
  const charts = CHARTS.filter((c) => c.for(job));
  const names = [...new Set(charts.flatMap((c) => [...c.names, ...(c.band || [])]))];
  const query = names.map((n) => `name=${encodeURIComponent(n)}`).join("&");
  const page = await api(`/fine_tuning/jobs/${encodeURIComponent(job.id)}/metrics?${query}&limit=10000`);
  const series = {};
  for (const point of page.data) (series[point.name] ||= []).push(point);
  $("charts").replaceChildren(...charts.map(({ title, names: candidates, titles, band }) => {
    const name = candidates.find((n) => series[n]);
    let intervals = null;
    if (band) {
      intervals = {};
      for (const [i, bound] of band.entries()) {
        for (const p of series[bound] || []) (intervals[p.step] ||= [null, null])[i] = p.value;
      }
    }
    return chart((titles && titles[name]) || title, name, name ? series[name] : [], intervals);
  }));
}

async function loadSamples(jobId) {
  let page;
  try {
    page = await api(`/fine_tuning/jobs/${encodeURIComponent(jobId)}/samples?limit=8`);
  } catch (e) {
    if (e.status !== 404) throw e;
    page = { data: [] }; // a service without the samples endpoint, or a job that has none
  }
  if (!page.data.length) {
    $("samples").replaceChildren(el("p", { class: "muted" }, "No samples yet."));
    return;
  }
  $("samples").replaceChildren(...page.data.map((s) => {
    const parts = Object.entries(s.rewards || {}).map(([k, v]) => `${k} ${number(v)}`).join(", ");
    return el("article", { class: "sample" },
      el("header", {}, `step ${s.step} · reward ${number(s.reward)} · advantage ${number(s.advantage)}`,
        parts ? el("span", { class: "muted" }, ` (${parts})`) : ""),
      el("div", { class: "label" }, "Prompt"), el("pre", { class: "prompt" }, s.prompt),
      el("div", { class: "label" }, "Completion"), el("pre", { class: "completion" }, s.completion));
  }));
}

async function loadEvents(jobId) {
  const page = await api(`/fine_tuning/jobs/${encodeURIComponent(jobId)}/events?limit=50`);
  $("events").replaceChildren(...page.data.map((e) => el("li", { class: `event level-${e.level}` },
    el("time", {}, when(e.created_at)), " ", el("span", { class: "message" }, e.message))));
}

async function download(jobId, ckpt, button) {
  button.disabled = true;
  try {
    const path = `/fine_tuning/jobs/${encodeURIComponent(jobId)}/checkpoints/${encodeURIComponent(ckpt.id)}/content`;
    const response = await api(path, { raw: true });
    const url = URL.createObjectURL(await response.blob());
    const link = el("a", { href: url, download: `${ckpt.id}-adapter.tar` });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
    notice(`Downloaded ${ckpt.id} (sha256 ${response.headers.get("x-sha256")})`);
  } catch (e) {
    notice(`Download failed: ${e.message}`, "error");
  } finally {
    button.disabled = false;
  }
}

// The checkpoint's own evaluation (held-out rows, at its step), not the training reward of its step's batch.
function checkpointEval(evaluation) {
  if (!evaluation) return "–";
  const parts = [];
  if (evaluation.mean !== undefined && evaluation.mean !== null) {
    const [low, high] = evaluation.interval || [];
    parts.push(`reward ${number(evaluation.mean)}` +
      (low !== null && low !== undefined && high !== null && high !== undefined ? ` [${number(low)}, ${number(high)}]` : ""));
  }
  if (evaluation.loss !== undefined && evaluation.loss !== null) parts.push(`loss ${number(evaluation.loss)}`);
  return parts.join(", ") || "–";
}

async function loadCheckpoints(jobId) {
  const page = await api(`/fine_tuning/jobs/${encodeURIComponent(jobId)}/checkpoints?limit=20`);
  $("checkpoints").querySelector("tbody").replaceChildren(...page.data.map((c) => {
    const button = el("button", { type: "button", class: "download" }, "Download adapter");
    button.addEventListener("click", () => download(jobId, c, button));
    return el("tr", {}, el("td", {}, c.step_number), el("td", { class: "mono" }, c.id),
      el("td", { class: "nowrap" }, checkpointEval(c.eval)), el("td", {}, button));
  }));
  $("checkpoints-empty").hidden = page.data.length > 0;
}

async function loadJob(jobId) {
  const job = await api(`/fine_tuning/jobs/${encodeURIComponent(jobId)}`);
  renderJob(job);
  await Promise.all([loadCharts(job), loadSamples(jobId), loadEvents(jobId), loadCheckpoints(jobId)]);
  return job;
}

async function control(action) {
  try {
    await api(`/fine_tuning/jobs/${encodeURIComponent(state.jobId)}/${action}`, { method: "POST" });
    notice(`Asked the job to ${action}.`);
  } catch (e) {
    notice(`Could not ${action}: ${e.message}`, "error");
  }
  refresh();
}

// -- refresh loop ------------------------------------------------------------------------------------

function select(jobId) {
  state.jobId = jobId;
  history.replaceState(null, "", `#${jobId}`);
  refresh();
}

async function refresh() {
  clearTimeout(state.timer);
  let live = false;
  try {
    const jobs = await loadJobs();
    if (!state.jobId && jobs.length) state.jobId = jobs[0].id;
    if (state.jobId) live = LIVE.has((await loadJob(state.jobId)).status);
    else $("job").hidden = true;
    live = live || jobs.some((j) => LIVE.has(j.status));
    if ($("notice").className === "error") notice("");
  } catch (e) {
    notice(e.message, "error");
  }
  document.body.dataset.loaded = "true"; // for tests and screenshots: the first render is done
  if (live) state.timer = setTimeout(refresh, REFRESH_MS); // nothing changes once every job has ended
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key").value.trim();
    if (key) localStorage.setItem(KEY_STORAGE, key);
    $("key").value = "";
    showKeyState();
    notice("");
    refresh();
  });
  $("forget").addEventListener("click", () => {
    localStorage.removeItem(KEY_STORAGE);
    location.hash = "";
    location.reload();
  });
  // Editing the #job-id in the address bar (or going back) shows that job.
  window.addEventListener("hashchange", () => {
    const { key, job } = fromFragment();
    if (key) takeKeyFromFragment(key, job);
    if (job && job !== state.jobId) select(job);
    else if (key) refresh();
  });
  const given = fromFragment();
  if (given.key) takeKeyFromFragment(given.key, given.job);
  showKeyState();
  for (const action of ["pause", "resume", "cancel"]) $(action).addEventListener("click", () => control(action));
  refresh();
});
