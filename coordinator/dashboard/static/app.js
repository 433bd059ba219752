// EdgeTrain dashboard: renders the coordinator's snapshot (GET /api/state, then /events).
"use strict";

const $ = (id) => document.getElementById(id);
const fmt = (v, digits = 1) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));
const SVG = "http://www.w3.org/2000/svg";

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
}

function renderBoards(boards) {
  const body = $("boards").querySelector("tbody");
  body.replaceChildren();
  for (const b of boards) {
    const tr = document.createElement("tr");
    tr.dataset.board = b.name;
    tr.dataset.state = b.state;
    if (b.state === "lost") tr.className = "lost";
    cell(tr, b.name);
    cell(tr, b.state, "state " + b.state);
    cell(tr, b.role || "–", "role");
    cell(tr, b.share ?? "–");
    cell(tr, fmt(b.samples_per_s));
    cell(tr, fmt(b.cpu_percent, 0));
    cell(tr, b.memory_used_bytes ? (b.memory_used_bytes / 2 ** 20).toFixed(0) + " MiB" : "–");
    cell(tr, b.battery_percent === null ? "–" : fmt(b.battery_percent, 0) + "%");
    cell(tr, b.temperature_c === null ? "–" : fmt(b.temperature_c, 0) + " °C");
    cell(tr, fmt(b.link_mbit_per_s));
    cell(tr, fmt(b.rtt_ms));
    cell(tr, b.codec || "–", "codec");
    body.appendChild(tr);
  }
}

const clock = (t) => (t ? new Date(t * 1000).toLocaleTimeString() : "–");

function renderJobs(jobs) {
  $("jobs-section").hidden = !jobs;
  if (!jobs) return;
  const body = $("jobs").querySelector("tbody");
  body.replaceChildren();
  for (const j of jobs) {
    const tr = document.createElement("tr");
    tr.dataset.job = j.id;
    cell(tr, `${j.id} ${j.name} (${j.model})`);
    cell(tr, j.state, "state");
    cell(tr, j.boards.join(", ") || j.request);
    cell(tr, `${j.steps_done}/${j.steps}`);
    cell(tr, clock(j.planned_start));
    cell(tr, clock(j.predicted_finish));
    cell(tr, `${fmt(j.predicted_samples_per_s)} / ${fmt(j.measured_samples_per_s)}`);
    body.appendChild(tr);
  }
}

function line(svg, points, cls) {
  const el = document.createElementNS(SVG, "polyline");
  el.setAttribute("points", points.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" "));
  if (cls) el.setAttribute("class", cls);
  svg.appendChild(el);
}

function chart(svg, xs, ys, extra) {
  svg.replaceChildren();
  const pts = xs.map((x, i) => [x, ys[i]]).filter(([, y]) => y !== null && y !== undefined);
  svg.dataset.points = String(pts.length);
  if (!pts.length) return;
  const all = pts.map(([, y]) => y).concat(extra ? [extra] : []);
  const x0 = Math.min(...pts.map(([x]) => x)), x1 = Math.max(...pts.map(([x]) => x));
  const y0 = Math.min(0, ...all), y1 = Math.max(...all) || 1;
  const sx = (x) => 30 + (x1 > x0 ? ((x - x0) / (x1 - x0)) * 360 : 180);
  const sy = (y) => 150 - ((y - y0) / (y1 - y0 || 1)) * 140;
  line(svg, pts.map(([x, y]) => [sx(x), sy(y)]));
  if (pts.length < 8) {  // few points (evaluations): mark each
    for (const [x, y] of pts) {
      const dot = document.createElementNS(SVG, "circle");
      dot.setAttribute("cx", sx(x).toFixed(1));
      dot.setAttribute("cy", sy(y).toFixed(1));
      dot.setAttribute("r", "3");
      svg.appendChild(dot);
    }
  }
  if (extra) line(svg, [[30, sy(extra)], [390, sy(extra)]], "ideal");
  const label = document.createElementNS(SVG, "text");
  label.setAttribute("x", "2");
  label.setAttribute("y", "12");
  label.textContent = fmt(y1, 2);
  svg.appendChild(label);
}

function renderTimeline(timeline) {
  const box = $("timeline");
  box.replaceChildren();
  const last = timeline[timeline.length - 1];
  if (!last) return;
  $("step").textContent = `step ${last.step}: ${fmt(last.step_s, 2)} s`;
  for (const [name, parts] of Object.entries(last.boards)) {
    const bar = document.createElement("div");
    bar.className = "bar";
    const label = document.createElement("span");
    label.className = "name";
    label.textContent = name;
    const track = document.createElement("span");
    track.className = "track";
    for (const part of ["compute", "comm", "waiting", "idle"]) {
      const v = parts[part + "_s"] || 0;
      const seg = document.createElement("span");
      seg.className = part;
      seg.style.width = `${(100 * v) / (last.step_s || 1)}%`;
      seg.title = `${part} ${fmt(v, 3)} s`;
      track.appendChild(seg);
    }
    bar.append(label, track);
    box.appendChild(bar);
  }
}

function renderEvents(plans, failures) {
  const list = $("events");
  list.replaceChildren();
  const items = plans.map((p) => ({ step: p.step, text: `step ${p.step}: ${p.switched ? "re-planned" : "plan kept"}` +
      (p.kind === "membership" ? ` over ${p.boards.join(", ")}` : "") +
      (p.reasons && p.reasons.length ? ` (${p.reasons.join("; ")})` : ""), kind: "plan" }))
    .concat(failures.map((f) => ({ step: f.step, text: `step ${f.step}: ` + (f.failed
      ? Object.entries(f.failed).map(([d, r]) => `${d} ${r}`).join("; ")
      : f.lost ? `attempt ${f.attempt} lost ${f.lost.join(", ")} (${f.outcome})`
      : f.no_usable_update ? `attempt ${f.attempt}: no usable update (` +
          Object.entries(f.no_usable_update).map(([d, r]) => `${d} ${r}`).join("; ") + ")"
      : f.lost_state ? "state lost with a stage owner" : "failure"), kind: "fault" })));
  items.sort((a, b) => a.step - b.step);
  for (const item of items) {
    const li = document.createElement("li");
    li.className = item.kind;
    li.textContent = item.text;
    list.appendChild(li);
  }
}

function render(state) {
  $("job").textContent = state.job;
  $("synthetic").hidden = !state.synthetic_data;
  renderJobs(state.jobs);
  renderBoards(state.boards);
  const steps = state.curves.map((c) => c.step);
  chart($("loss"), steps, state.curves.map((c) => c.loss));
  chart($("throughput"), steps, state.curves.map((c) => c.samples_per_s), state.ideal_samples_per_s);
  $("ideal").textContent = state.ideal_samples_per_s ? `(dashed: ideal ${fmt(state.ideal_samples_per_s)})` : "";
  chart($("accuracy"), state.evals.map((e) => e.step), state.evals.map((e) => e.accuracy));
  renderTimeline(state.timeline);
  renderEvents(state.plans, state.failures);
}

function connect() {
  const source = new EventSource("/events");
  source.onopen = () => { $("connection").textContent = "live"; };
  source.onmessage = (event) => render(JSON.parse(event.data));
  source.onerror = () => { $("connection").textContent = "reconnecting…"; };
}

fetch("/api/state").then((r) => r.json()).then(render).then(connect);
