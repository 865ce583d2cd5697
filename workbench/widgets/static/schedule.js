// Pipeline schedule widget: stages x time, forward (plain) and backward (hatched) chunks per
// micro-batch coloured by micro-batch, idle time (the bubble) shaded. The controls change the
// schedule, micro-batches and repeats; the timeline is recomputed here exactly as
// workbench.models.pipeline.timeline computes it (the Python test checks both agree).
import { colour, el, ink, select } from "./common.js";

/** Each stage's operations in order: [kind, item] with item = repeat * M + micro. */
export function stageOrders(schedule, stages, m, r) {
  const orders = [];
  for (let s = 0; s < stages; s++) {
    const ops = [];
    if (schedule === "1f1b") {
      const warm = Math.min(stages - s - 1, m);
      for (let i = 0; i < warm; i++) ops.push(["F", i]);
      for (let j = 0; j < m - warm; j++) ops.push(["F", warm + j], ["B", j]);
      for (let j = m - warm; j < m; j++) ops.push(["B", j]);
    } else {
      for (let i = 0; i < m * r; i++) ops.push(["F", i]);
      for (let i = m * r - 1; i >= 0; i--) ops.push(["B", i]);
    }
    orders.push(ops);
  }
  return orders;
}

/** The timeline: every operation starts when its stage is free and its input has arrived. */
export function timeline(schedule, stages, m, r, backwardCost) {
  const f = 1 / r;
  const b = backwardCost / r;
  const orders = stageOrders(schedule, stages, m, r);
  const end = new Map();
  const pos = new Array(stages).fill(0);
  const free = new Array(stages).fill(0);
  const events = [];
  const total = orders.reduce((a, o) => a + o.length, 0);
  while (events.length < total) {
    let progressed = false;
    for (let s = 0; s < stages; s++) {
      while (pos[s] < orders[s].length) {
        const [kind, i] = orders[s][pos[s]];
        let dep = null;
        if (kind === "F") dep = s > 0 ? `F,${s - 1},${i}` : i >= m ? `F,${stages - 1},${i - m}` : null;
        else dep = s < stages - 1 ? `B,${s + 1},${i}` : i + m < m * r ? `B,0,${i + m}` : `F,${s},${i}`;
        if (dep !== null && !end.has(dep)) break;
        const start = Math.max(free[s], dep !== null ? end.get(dep) : 0);
        const stop = start + (kind === "F" ? f : b);
        end.set(`${kind},${s},${i}`, stop);
        free[s] = stop;
        events.push({ stage: s, start, end: stop, kind, micro: i % m, repeat: Math.floor(i / m) });
        pos[s] += 1;
        progressed = true;
      }
    }
    if (!progressed) throw new Error(`schedule ${schedule} deadlocks`);
  }
  return events;
}

function facts(p, events) {
  const span = Math.max(...events.map((e) => e.end));
  const busy = events.reduce((a, e) => a + e.end - e.start, 0);
  const bubble = 1 - busy / (p.stages * span);
  const formula = (p.stages - 1) / (p.repeats * p.microbatches + p.stages - 1);
  return { span, bubble, formula };
}

function draw(p, body) {
  const events = timeline(p.schedule, p.stages, p.microbatches, p.repeats, p.backward_cost);
  const { span, bubble, formula } = facts(p, events);
  const rows = el("div", { class: "wb-schedule-rows" });
  for (let s = 0; s < p.stages; s++) {
    const track = el("div", { class: "wb-schedule-track", "data-stage": s });
    for (const e of events.filter((x) => x.stage === s)) {
      const bg = colour(e.micro, p.microbatches);
      const label = `${e.kind}${e.micro}${p.repeats > 1 ? `.${e.repeat}` : ""}`;
      track.appendChild(el("div", {
        class: `wb-block ${e.kind === "B" ? "wb-backward" : "wb-forward"}`,
        "data-block": `${e.kind}:${e.stage}:${e.micro}:${e.repeat}`,
        "data-devices": `${e.start.toFixed(6)}-${e.end.toFixed(6)}`,
        title: `stage ${s}: ${e.kind === "F" ? "forward" : "backward"} of micro-batch ${e.micro}` +
          `${p.repeats > 1 ? `, round ${e.repeat}` : ""}, t = ${e.start.toFixed(2)}–${e.end.toFixed(2)}`,
        style: { left: `${(100 * e.start / span).toFixed(4)}%`, width: `${(100 * (e.end - e.start) / span).toFixed(4)}%`,
          background: bg, color: ink(bg) },
        text: label,
      }));
    }
    rows.append(el("div", { class: "wb-schedule-label", text: `stage ${s}` }), track);
  }
  const pct = (x) => `${(100 * x).toFixed(1)}%`;
  body.replaceChildren(
    rows,
    el("div", { class: "wb-schedule-axis" }, [el("span", { text: "0" }),
      el("span", { text: `time (one stage's forward of one micro-batch = 1; backward = ${p.backward_cost})` }),
      el("span", { text: span.toFixed(2) })]),
    el("div", { class: "wb-schedule-facts wb-bubble", "data-bubble": bubble.toFixed(6),
      text: `bubble (shaded): ${pct(bubble)} of the stages' time; formula (S-1)/(R·M+S-1) = ` +
        `(${p.stages}-1)/(${p.repeats}·${p.microbatches}+${p.stages}-1) = ${pct(formula)}` }),
  );
}

function render({ model, el: root }) {
  const body = el("div", {});
  const p = () => model.get("payload");
  const update = (changes) => {
    const next = { ...p(), ...changes };
    if (next.schedule !== "circular") next.repeats = 1;
    model.set("payload", next);
    model.save_changes();
  };
  const number = (label, key, min) => {
    const input = el("input", { type: "number", min, value: p()[key], "aria-label": label });
    input.value = String(p()[key]);
    input.addEventListener("change", () => {
      const v = Math.max(min, Math.floor(Number(input.value)) || min);
      update({ [key]: v });
    });
    return el("label", { class: "wb-control" }, [`${label} `, input]);
  };
  const controls = el("div", { class: "wb-schedule-controls" }, [
    el("span", { class: "wb-title", text: "pipeline schedule" }),
    select("schedule", p().schedules.map((s) => [s, s]), p().schedule, (v) => update({ schedule: v })),
    number("stages", "stages", 1),
    number("micro-batches", "microbatches", 1),
    number("repeats", "repeats", 1),
  ]);
  const container = el("div", { class: "wb-schedule" }, [controls, body]);
  root.replaceChildren(container);
  const redraw = () => draw(p(), body);
  redraw();
  model.on("change:payload", redraw);
  return () => model.off("change:payload", redraw);
}

export default { render };
