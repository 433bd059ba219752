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
    cell(tr, b.device || "–", "device");
    cell(tr, b.share ?? "–");
    cell(tr, ownData(b.own_data), "data");
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

// a board's own images (never shown): their count, and per class when the board shared that
function ownData(own) {
  if (!own) return "served";
  const classes = own.class_counts
    ? " (" + Object.entries(own.class_counts).map(([name, n]) => `${name} ${n}`).join(", ") + ")"
    : "";
  return `own: ${own.samples}${classes}`;
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
    const td = document.createElement("td");
    if (j.dashboard) {  // the job's own coordinator serves its run: curves, plan, steps
      const a = document.createElement("a");
      a.href = j.dashboard;
      a.target = "_blank";
      a.rel = "noopener";
      a.textContent = "run";
      td.appendChild(a);
    } else {
      td.textContent = "–";
    }
    tr.appendChild(td);
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
  // one row per board: its last steps side by side, each as wide as the step took, split into
  // compute, communication, waiting and idle (a board without work in a step: an empty gap)
  const box = $("timeline");
  box.replaceChildren();
  const last = timeline[timeline.length - 1];
  if (!last) return;
  $("step").textContent = `steps ${timeline[0].step}–${last.step}; step ${last.step}: ${fmt(last.step_s, 2)} s`;
  const total = timeline.reduce((sum, s) => sum + (s.step_s || 0), 0) || 1;
  const names = [...new Set(timeline.flatMap((s) => Object.keys(s.boards)))];
  for (const name of names) {
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.dataset.board = name;
    const label = document.createElement("span");
    label.className = "name";
    label.textContent = name;
    const track = document.createElement("span");
    track.className = "track";
    for (const step of timeline) {
      const parts = step.boards[name];
      const cell = document.createElement("span");
      cell.className = "stepcell";
      cell.style.width = `${(100 * (step.step_s || 0)) / total}%`;
      cell.title = `step ${step.step}: ${fmt(step.step_s, 2)} s`;
      if (parts) {
        for (const part of ["compute", "comm", "waiting", "idle"]) {
          const v = parts[part + "_s"] || 0;
          const seg = document.createElement("span");
          seg.className = part;
          seg.style.width = `${(100 * v) / (step.step_s || 1)}%`;
          seg.title = `step ${step.step} ${part} ${fmt(v, 3)} s`;
          cell.appendChild(seg);
        }
      }
      track.appendChild(cell);
    }
    bar.append(label, track);
    box.appendChild(bar);
  }
}

function box(cls, title, lines) {
  const el = document.createElement("div");
  el.className = "node " + cls;
  const head = document.createElement("div");
  head.className = "head";
  head.textContent = title;
  el.appendChild(head);
  for (const text of lines) {
    const row = document.createElement("div");
    row.className = "host";
    row.textContent = text;
    el.appendChild(row);
  }
  return el;
}

function renderPlan(plan) {
  // the plan the last step ran: stages left to right (a stage with several hosts is a group
  // splitting its samples, or a channel group splitting each layer's channels), DP shards below with their samples, boards left out
  const picture = $("plan");
  picture.replaceChildren();
  $("plan-times").textContent = "";
  if (!plan) return;
  const head = { dp: "data parallelism", pipeline: "pipeline", hybrid: "pipeline + data-parallel shards" }[plan.kind];
  $("plan-kind").textContent = `${head} (${plan.source}), step ${plan.step}` +
    (plan.microbatches ? `; ${plan.microbatches} micro-batches, ${plan.schedule}` : "");
  $("plan-times").textContent = `step time: predicted ${fmt(plan.predicted_step_s, 2)} s, ` +
    `measured ${fmt(plan.measured_step_s, 2)} s (median of the last steps)`;
  if (plan.stages.length) {
    const row = document.createElement("div");
    row.className = "stages";
    plan.stages.forEach((s, i) => {
      if (i) {
        const arrow = document.createElement("span");
        arrow.className = "arrow";
        arrow.textContent = "→";
        row.appendChild(arrow);
      }
      const blocks = s.blocks ? `: blocks ${s.blocks[0]}–${s.blocks[1] - 1}` : "";
      const group = s.split === "channels" ? " (channel group)" : s.boards.length > 1 ? " (group)" : "";
      const share = (b) => b.channels ? ` · channels ${Math.round(b.channels[0] * 100)}–${Math.round(b.channels[1] * 100)}%` : "";
      const node = box("stage", `stage ${s.stage}${blocks}${group}`,
        s.boards.map((b) => b.name + (b.samples ? ` · ${b.samples} samples` : "") + share(b)));
      node.dataset.stage = String(s.stage);
      row.appendChild(node);
    });
    picture.appendChild(row);
  }
  if (plan.shards.length) {
    const total = plan.shards.reduce((sum, b) => sum + (b.samples || 0), 0) || 1;
    const node = box("shards", plan.stages.length ? "data-parallel shards (whole model)" : "data-parallel shards", []);
    for (const b of plan.shards) {
      const row = document.createElement("div");
      row.className = "shard";
      row.dataset.board = b.name;
      const label = document.createElement("span");
      label.className = "name";
      label.textContent = `${b.name} · ${b.samples} samples`;
      const fill = document.createElement("span");
      fill.className = "fill";
      fill.style.width = `${(100 * (b.samples || 0)) / total}%`;
      row.append(label, fill);
      node.appendChild(row);
    }
    picture.appendChild(node);
  }
  if ((plan.local || []).length) {
    picture.appendChild(box("local", "beside the steps (local updates, staleness-weighted)", plan.local));
  }
  const out = Object.entries(plan.left_out || {});
  if (out.length) picture.appendChild(box("left", "left out", out.map(([b, why]) => `${b}: ${why}`)));
  if (plan.measured) {
    const m = plan.measured;
    const phi = m.noise_scale == null ? "unknown" : fmt(m.noise_scale, 0);
    picture.appendChild(box("measured", `measured before committing (steps ${m.steps[0]}–${m.steps[1] - 1}, noise scale ${phi})`,
      m.candidates.map((c) => `${c.kept ? "kept: " : ""}${c.plan} · ${fmt(c.measured_step_s, 3)} s/step · ` +
        `efficiency ${fmt(c.efficiency, 3)} · score ${fmt(c.score, 1)}`)));
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

const drawn = {};  // section -> the JSON it was last drawn from: an unchanged section is not redrawn

function changed(section, ...parts) {
  const key = JSON.stringify(parts);
  if (drawn[section] === key) return false;
  drawn[section] = key;
  return true;
}

function render(state) {
  $("job").textContent = state.job;
  $("synthetic").hidden = !state.synthetic_data;
  if (changed("jobs", state.jobs)) renderJobs(state.jobs);
  if (changed("boards", state.boards)) renderBoards(state.boards);
  if (changed("curves", state.curves, state.evals, state.ideal_samples_per_s)) {
    const steps = state.curves.map((c) => c.step);
    chart($("loss"), steps, state.curves.map((c) => c.loss));
    chart($("throughput"), steps, state.curves.map((c) => c.samples_per_s), state.ideal_samples_per_s);
    $("ideal").textContent = state.ideal_samples_per_s ? `(dashed: ideal ${fmt(state.ideal_samples_per_s)})` : "";
    chart($("accuracy"), state.evals.map((e) => e.step), state.evals.map((e) => e.accuracy));
    let energy = 0;  // the boards' energy, summed over the steps the view holds
    chart($("energy"), steps, state.curves.map((c) => (c.energy_j === null ? null : (energy += c.energy_j))));
  }
  if (changed("plan", state.plan)) renderPlan(state.plan);
  if (changed("timeline", state.timeline)) renderTimeline(state.timeline);
  if (changed("events", state.plans, state.failures)) renderEvents(state.plans, state.failures);
}

function connect() {
  const source = new EventSource("/events");
  source.onopen = () => { $("connection").textContent = "live"; };
  source.onmessage = (event) => render(JSON.parse(event.data));
  source.onerror = () => { $("connection").textContent = "reconnecting…"; };
}

fetch("/api/state").then((r) => r.json()).then(render).then(connect);
