// Job widget: a launched multi-process job — status per process, live loss and MFU read
// from the run directory, the last log lines of every process, and a Stop button.
// Its helpers come from common.js, inlined by workbench/widgets/_assets.py for anywidget.

import { el, svg } from "./common.js";

function fmt(v, digits = 4) {
  return typeof v === "number" && Number.isFinite(v) ? v.toPrecision(digits) : "—";
}

/** A small line chart of [[step, value], ...] with min/max labels; no library needed. */
export function lineChart(title, points, { width = 300, height = 130, percent = false } = {}) {
  const box = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img" });
  const label = svg("text", { x: 6, y: 13, "font-size": 11, fill: "currentColor" });
  label.textContent = title;
  box.appendChild(label);
  if (!points || points.length === 0) {
    const none = svg("text", { x: width / 2, y: height / 2, "text-anchor": "middle", "font-size": 11, fill: "#888" });
    none.textContent = "waiting for the first step…";
    box.appendChild(none);
    return box;
  }
  const pad = { l: 44, r: 8, t: 20, b: 18 };
  const xs = points.map((p) => p[0]);
  const ys = points.map((p) => (percent ? 100 * p[1] : p[1]));
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => pad.l + ((x - x0) / Math.max(1, x1 - x0)) * (width - pad.l - pad.r);
  const sy = (y) => height - pad.b - ((y - y0) / (y1 - y0)) * (height - pad.t - pad.b);
  const d = points.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(ys[i]).toFixed(1)}`).join("");
  box.appendChild(svg("path", { d, fill: "none", stroke: "#4e79a7", "stroke-width": 1.5 }));
  const unit = percent ? "%" : "";
  for (const [y, v] of [[pad.t + 4, y1], [height - pad.b, y0]]) {
    const t = svg("text", { x: pad.l - 4, y, "text-anchor": "end", "font-size": 10, fill: "#666" });
    t.textContent = `${fmt(v, 3)}${unit}`;
    box.appendChild(t);
  }
  for (const [x, anchor, v] of [[pad.l, "start", x0], [width - pad.r, "end", x1]]) {
    const t = svg("text", { x, y: height - 4, "text-anchor": anchor, "font-size": 10, fill: "#666" });
    t.textContent = `step ${v}`;
    box.appendChild(t);
  }
  return box;
}

function header(p, onStop) {
  const target = p.target_steps ? ` of ${p.target_steps}` : "";
  const facts = [
    `${p.processes.length} process${p.processes.length === 1 ? "" : "es"}` +
      (p.devices_per_process ? ` × ${p.devices_per_process} ${p.platform || ""} devices` : ""),
    `step ${p.step}${target}`,
    `loss ${fmt(p.latest.loss)}`,
    p.latest.mfu !== null && p.latest.mfu !== undefined ? `MFU ${fmt(100 * p.latest.mfu, 3)}% (${p.latest.peak_source || "peak"})` : null,
    p.latest.step_time ? `${fmt(p.latest.step_time, 3)} s/step` : null,
  ];
  const stop = el("button", {
    class: "wb-stop", text: p.done ? "done" : "Stop", disabled: p.done ? "disabled" : null,
    title: "SIGTERM: every process saves a checkpoint at the same step, then exits",
    onclick: (e) => {
      if (p.done) return;
      e.target.disabled = true;
      e.target.textContent = "stopping…";
      onStop();
    },
  });
  return el("div", { class: "wb-header" }, [
    el("span", { class: "wb-title", text: `job ${p.name}` }),
    el("span", { class: `wb-badge wb-${p.status}`, text: p.status }),
    el("span", { class: "wb-facts", text: facts.filter((x) => x).join(" · ") }),
    stop,
  ]);
}

function progress(p) {
  const frac = p.target_steps ? Math.min(1, p.step / p.target_steps) : 0;
  return el("div", { class: "wb-bar", title: `${(100 * frac).toFixed(1)}%` }, [
    el("div", { style: { width: `${(100 * frac).toFixed(1)}%` } })]);
}

function processTable(p) {
  const rows = p.processes.map((q) => el("tr", { class: "wb-row" }, [
    el("td", { class: "wb-num", text: q.index }),
    el("td", { class: "wb-num", text: q.pid }),
    el("td", {}, [el("span", { class: `wb-badge wb-${q.state}`, text: q.state })]),
    el("td", { class: "wb-num", text: q.returncode === null ? "" : q.returncode }),
    el("td", { text: q.log }),
  ]));
  const head = ["process", "pid", "state", "exit", "log"].map((h) => el("th", { text: h }));
  return el("table", { class: "wb-table" }, [el("thead", {}, [el("tr", {}, head)]), el("tbody", {}, rows)]);
}

function tails(p, open) {
  return p.processes.map((q) => {
    const lines = p.tails[String(q.index)] || [];
    const det = el("details", { open: open.has(q.index) ? "open" : null }, [
      el("summary", { text: `process ${q.index}: last ${lines.length} log lines` }),
      el("pre", { text: lines.join("\n") }),
    ]);
    det.addEventListener("toggle", () => (det.open ? open.add(q.index) : open.delete(q.index)));
    return det;
  });
}

function render({ model, el: host }) {
  const root = el("div", { class: "wb-widget wb-job" });
  host.appendChild(root);
  const open = new Set();
  const onStop = () => model.send({ type: "stop" });
  function draw() {
    const p = model.get("payload");
    if (!p || !p.processes) { root.replaceChildren(el("div", { class: "wb-note", text: "no job" })); return; }
    if (p.status === "failed") p.processes.forEach((q) => { if (q.state === "failed") open.add(q.index); });
    root.replaceChildren(...[
      header(p, onStop),
      progress(p),
      p.failure ? el("div", { class: "wb-error", text: p.failure }) : null,
      el("div", { class: "wb-charts" }, [
        lineChart("loss", p.loss),
        lineChart("MFU", p.mfu, { percent: true }),
      ]),
      processTable(p),
      ...tails(p, open),
      el("div", { class: "wb-note", text: `run directory ${p.run_dir} — also in the Workbench runs panel` }),
    ].filter((node) => node !== null));
  }
  draw();
  model.on("change:payload", draw);
  return () => model.off("change:payload", draw);
}

export default { render };
