"use strict";
// The play page of `worldpipe serve` (worldpipe.rollout.http.play): plain JS, no build step, no outside fetches.
// Sessions: POST /sessions opens one on a held-out context, /extend imagines one step per key, /fork copies a
// branch so two action sequences can be compared side by side. A step's response with `frames`
// ([H,3,64,64] uint8, pixel models) is drawn as a picture; otherwise the imagined state is plotted.
// URL query (also for scripted, headless use): model, context (index), length, sampling (sample|mean), seed,
// keys (L R U D N = ← → ↑ ↓ space, F fork, B next branch; played in order after the start).

const KEYMAP = {ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [1, 1], ArrowDown: [1, -1], " ": [0, 0]};
const SCRIPT_KEYS = {L: "ArrowLeft", R: "ArrowRight", U: "ArrowUp", D: "ArrowDown", N: " ", F: "f", B: "b"};
const ARROWS = {ArrowLeft: "←", ArrowRight: "→", ArrowUp: "↑", ArrowDown: "↓", " ": "·"};
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f"];
const WIDTH = 480, HEIGHT = 300;

const params = new URLSearchParams(location.search);
const play = {models: [], model: null, contexts: [], context: null, branches: [], active: 0,
              queue: Promise.resolve(), generation: 0};
const $ = (id) => document.getElementById(id);

function setStatus(text, error = false) {
  const el = $("status");
  el.textContent = text;
  el.className = error ? "error" : "";
  if (error) document.body.dataset.error = text;
}

function errorLine(status, detail) {
  if (Array.isArray(detail)) detail = detail.map((d) => `${(d.loc || []).join(".")}: ${d.msg}`).join("; ");
  return `HTTP ${status}: ${detail}`;
}

async function api(method, path, body, token) {
  const headers = {"Content-Type": "application/json"};
  if (token) headers["X-Session-Token"] = token;
  const response = await fetch(path, {method, headers, body: body === undefined ? undefined : JSON.stringify(body)});
  const data = await response.json().catch(() => ({detail: response.statusText}));
  if (!response.ok) throw new Error(`${method} ${path.split("?")[0]}: ${errorLine(response.status, data.detail)}`);
  return data;
}

// Keys are handled one after another: a step waits for the previous step's answer.
function enqueue(task) {
  play.queue = play.queue.then(task).catch((err) => setStatus(err.message, true));
  return play.queue;
}

function fnv1a(bytes) {
  let h = 0x811c9dc5;
  for (let i = 0; i < bytes.length; i++) h = Math.imul(h ^ bytes[i], 0x01000193) >>> 0;
  return h.toString(16).padStart(8, "0");
}

// ---- loading ----
async function loadModels() {
  const listed = await api("GET", "/models");
  play.models = listed.models;
  const select = $("model");
  select.replaceChildren(...play.models.map((m) => new Option(
    `step ${m.step} · ${m.version.slice(0, 12)}${m.version === listed.latest ? " (latest)" : ""}`, m.version)));
  const wanted = params.get("model");
  if (wanted && !play.models.some((m) => m.version === wanted)) {
    throw new Error(`model: version ${wanted} is not served here (GET /models lists what is)`);
  }
  select.value = wanted || listed.latest;
  play.model = play.models.find((m) => m.version === select.value);
}

async function loadContexts() {
  const query = new URLSearchParams({model: play.model.version, length: params.get("length") || "8",
                                   start: params.get("context") || "0", count: "32"});
  const listed = await api("GET", `/contexts?${query}`);
  play.contexts = listed.contexts;
  $("context").replaceChildren(...play.contexts.map((c) => new Option(`#${c.index} of ${listed.total}`, c.index)));
  const wanted = Number(params.get("context") || play.contexts[0].index);
  if (!play.contexts.some((c) => c.index === wanted)) {
    throw new Error(`context: no held-out window #${wanted} (there are ${listed.total})`);
  }
  $("context").value = String(wanted);
}

// ---- sessions ----
async function start() {
  play.generation += 1;
  for (const b of play.branches) api("DELETE", `/sessions/${b.session}`, undefined, b.token).catch(() => {});
  play.branches = [];
  play.active = 0;
  play.context = play.contexts.find((c) => String(c.index) === $("context").value);
  const seed = Number(params.get("seed") || "0");
  const opened = await api("POST", "/sessions", {
    context: {obs: play.context.obs, action: play.context.action},
    sampling: {mode: params.get("sampling") || "sample"},
    rng: {seed, stream: `play-${play.context.index}`},
    model_version: play.model.version,
  });
  addBranch({session: opened.session_id, token: opened.token, actions: [], keys: [], observations: [], frame: null});
  setStatus(`session ${opened.session_id} on held-out context #${play.context.index}: press an arrow key`);
}

function actionFor(key) {
  const action = new Array(play.model.act_dim).fill(0);
  const [dim, value] = KEYMAP[key];
  if (dim < action.length) action[dim] = value;
  return action;
}

async function step(key) {
  const branch = play.branches[play.active];
  if (!branch) throw new Error("no session: press start");
  const action = actionFor(key);
  const result = await api("POST", `/sessions/${branch.session}/extend`, {actions: [action]}, branch.token);
  branch.actions.push(action);
  branch.keys.push(ARROWS[key]);
  branch.observations.push(...result.observations);
  if (result.frames && result.frames.length) branch.frame = result.frames[result.frames.length - 1];
  redraw(branch);
  setStatus(`branch ${branch.name}: step ${result.step}, action [${action.join(", ")}]`);
}

async function fork() {
  const parent = play.branches[play.active];
  if (!parent) throw new Error("no session to fork: press start");
  const child = await api("POST", `/sessions/${parent.session}/fork`, {}, parent.token);
  addBranch({session: child.session_id, token: child.token, actions: [...parent.actions], keys: [...parent.keys],
             observations: [...parent.observations], frame: parent.frame, parent: parent.name});
  setStatus(`branch ${play.branches[play.active].name} forked from ${parent.name} at step ${child.step}`);
}

function addBranch(branch) {
  branch.name = String.fromCharCode(65 + play.branches.length);
  branch.el = document.createElement("section");
  branch.el.className = "branch";
  branch.el.innerHTML = `<h2></h2><canvas width="${WIDTH}" height="${HEIGHT}"></canvas><div class="actions"></div>`;
  branch.canvas = branch.el.querySelector("canvas");
  branch.digests = [];
  $("branches").appendChild(branch.el);
  play.branches.push(branch);
  play.active = play.branches.length - 1;
  redraw(branch);
}

// ---- drawing ----
// Every branch is redrawn (they share the y scale); `changed`, the branch that just moved, records its digest.
function redraw(changed = null) {
  const imagined = play.branches.flatMap((b) => b.observations);
  const values = [...play.context.obs, ...imagined].flat();
  let lo = Math.min(...values), hi = Math.max(...values);
  const pad = (hi - lo || 1) * 0.1;
  const scale = {lo: lo - pad, hi: hi + pad, steps: Math.max(8, ...play.branches.map((b) => b.observations.length))};
  play.branches.forEach((b, i) => {
    const ctx = b.canvas.getContext("2d");
    if (b.frame) drawFrame(ctx, b.frame); else drawState(ctx, b, scale);
    b.canvas.dataset.digest = fnv1a(ctx.getImageData(0, 0, WIDTH, HEIGHT).data);
    if (b === changed) b.digests.push(b.canvas.dataset.digest);
    b.el.classList.toggle("active", i === play.active);
    b.el.querySelector("h2").textContent = `branch ${b.name}${b.parent ? ` (fork of ${b.parent})` : ""}` +
      ` · step ${b.actions.length}${i === play.active ? " · active" : ""}`;
    b.el.querySelector(".actions").textContent = b.keys.join(" ") || "(no actions yet)";
    Object.assign(b.el.dataset, {name: b.name, session: b.session, steps: String(b.actions.length),
                                 actions: JSON.stringify(b.actions), digests: b.digests.join(","),
                                 lastObs: JSON.stringify(b.observations[b.observations.length - 1] || null),
                                 kind: b.frame ? "frame" : "state"});
  });
}

function drawState(ctx, branch, scale) {
  const context = play.context.obs, first = -(context.length - 1);
  const left = 40, right = WIDTH - 10, top = 10, bottom = HEIGHT - 25;
  const x = (t) => left + (t - first) / (scale.steps - first) * (right - left);
  const y = (v) => bottom - (v - scale.lo) / (scale.hi - scale.lo) * (bottom - top);
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, WIDTH, HEIGHT);
  ctx.strokeStyle = "#999";
  ctx.lineWidth = 1;
  ctx.strokeRect(left, top, right - left, bottom - top);
  ctx.setLineDash([4, 4]);
  ctx.beginPath(); ctx.moveTo(x(0), top); ctx.lineTo(x(0), bottom); ctx.stroke();
  ctx.setLineDash([]);
  ctx.fillStyle = "#444";
  ctx.font = "11px sans-serif";
  ctx.fillText(scale.hi.toFixed(2), 2, top + 10);
  ctx.fillText(scale.lo.toFixed(2), 2, bottom);
  ctx.fillText("held-out context", left + 4, bottom + 15);
  ctx.fillText("imagined →", x(0) + 4, bottom + 15);
  for (let d = 0; d < context[0].length; d++) {
    const color = COLORS[d % COLORS.length];
    const path = (points, alpha, width) => {
      ctx.globalAlpha = alpha; ctx.strokeStyle = color; ctx.lineWidth = width;
      ctx.beginPath();
      points.forEach(([t, v], k) => (k ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
      ctx.stroke();
    };
    path(context.map((o, k) => [first + k, o[d]]), 0.45, 1.5);
    path([[0, context[context.length - 1][d]], ...branch.observations.map((o, k) => [k + 1, o[d]])], 1, 2);
    ctx.globalAlpha = 1;
    ctx.fillStyle = color;
    ctx.fillText(`obs[${d}]`, right - 50, top + 14 * (d + 1));
  }
}

function drawFrame(ctx, frame) {
  const [channels, h, w] = [frame.length, frame[0].length, frame[0][0].length];
  const image = new ImageData(w, h);
  for (let i = 0; i < h; i++) {
    for (let j = 0; j < w; j++) {
      const p = 4 * (i * w + j);
      for (let c = 0; c < 3; c++) image.data[p + c] = frame[Math.min(c, channels - 1)][i][j];
      image.data[p + 3] = 255;
    }
  }
  const small = document.createElement("canvas");
  small.width = w; small.height = h;
  small.getContext("2d").putImageData(image, 0, 0);
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, WIDTH, HEIGHT);
  ctx.imageSmoothingEnabled = false;
  const side = Math.min(WIDTH, HEIGHT);
  ctx.drawImage(small, (WIDTH - side) / 2, 0, side, side);
}

// ---- keyboard and script ----
function onKey(key) {
  if (key in KEYMAP) return enqueue(() => step(key));
  if (key === "f" || key === "F") return enqueue(fork);
  if (key === "b" || key === "B") {
    return enqueue(async () => { play.active = (play.active + 1) % Math.max(1, play.branches.length); redraw(); });
  }
  return null;
}

document.addEventListener("keydown", (event) => {
  if (event.target.tagName === "SELECT") return;
  if (onKey(event.key) !== null) event.preventDefault();
});

async function runScript(keys) {
  for (const [i, c] of [...keys].entries()) {
    if (!(c in SCRIPT_KEYS)) throw new Error(`keys: unknown key '${c}' at position ${i} (use ${Object.keys(SCRIPT_KEYS).join(" ")})`);
    document.dispatchEvent(new KeyboardEvent("keydown", {key: SCRIPT_KEYS[c], bubbles: true}));
    await play.queue;
    if (document.body.dataset.error) return;
  }
  setStatus(`played ${keys}: ${play.branches.map((b) => `${b.name} ${b.keys.join("")}`).join(" | ")}`);
}

async function main() {
  // Not itself queued: the script's keys queue behind it.
  await enqueue(async () => { await loadModels(); await loadContexts(); await start(); });
  if (params.get("keys") && !document.body.dataset.error) await runScript(params.get("keys"));
}

$("start").addEventListener("click", () => enqueue(start));
$("fork").addEventListener("click", () => enqueue(fork));
$("model").addEventListener("change", () => enqueue(async () => {
  play.model = play.models.find((m) => m.version === $("model").value);
  await loadContexts();
  await start();
}));
$("context").addEventListener("change", () => enqueue(start));
main().catch((err) => setStatus(err.message, true)).then(() => { document.body.dataset.done = "1"; });
