// Job widget: a launched multi-process job — status per process, live loss and MFU read
// from the run directory, the last log lines of every process, and a Stop button.
// Its helpers come from common.js, inlined by workbench/widgets/_assets.py for anywidget.

import { el, fmtNum, lineChart, progressBar } from "./common.js";

function header(p, onStop) {
  const target = p.target_steps ? ` of ${p.target_steps}` : "";
  const facts = [
    `${p.processes.length} process${p.processes.length === 1 ? "" : "es"}` +
      (p.devices_per_process ? ` × ${p.devices_per_process} ${p.platform || ""} devices` : ""),
    `step ${p.step}${target}`,
    `loss ${fmtNum(p.latest.loss)}`,
    p.latest.mfu !== null && p.latest.mfu !== undefined ? `MFU ${fmtNum(100 * p.latest.mfu, 3)}% (${p.latest.peak_source || "peak"})` : null,
    typeof p.latest.mfu_fp8 === "number" ? `MFU ${fmtNum(100 * p.latest.mfu_fp8, 3)}% of the fp8 peak` : null,
    p.latest.step_time ? `${fmtNum(p.latest.step_time, 3)} s/step` : null,
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
    el("span", { class: `wb-status wb-${p.status}`, text: p.status }),
    el("span", { class: "wb-facts", text: facts.filter((x) => x).join(" · ") }),
    stop,
  ]);
}

// A SLURM job: its id, the scheduler's state (with why it waits, or where it runs), and the
// states it went through (a requeue shows as RUNNING → REQUEUED → PENDING → RUNNING).
function schedulerLine(p) {
  const s = p.scheduler;
  if (!s) return null;
  const why = s.reason && s.reason !== "None" ? ` (${s.reason})` : "";
  const where = s.nodes && s.state === "RUNNING" ? ` on ${s.nodes}` : "";
  const restarts = s.restarts ? ` · requeued ${s.restarts}×` : "";
  const history = (s.history || []).map((h) => h.state).join(" → ");
  return el("div", { class: "wb-scheduler" }, [
    el("span", { text: `SLURM job ${s.job_id}: ` }),
    el("span", { class: `wb-status wb-slurm-${s.state.toLowerCase()}`, text: s.state }),
    el("span", { text: `${why}${where}${restarts}` }),
    history ? el("span", { class: "wb-note", text: ` · ${history}` }) : null,
  ].filter((node) => node !== null));
}

function processTable(p) {
  const rows = p.processes.map((q) => el("tr", { class: "wb-row" }, [
    el("td", { class: "wb-num", text: q.index }),
    el("td", { class: "wb-num", text: q.pid === null ? "" : q.pid }),
    el("td", {}, [el("span", { class: `wb-status wb-${q.state}`, text: q.state })]),
    el("td", { class: "wb-num", text: q.returncode === null ? "" : q.returncode }),
    el("td", { text: q.log }),
  ]));
  const head = [p.scheduler ? "task" : "process", "pid", "state", "exit", "log"].map((h) => el("th", { text: h }));
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
  const bar = progressBar();
  const loss = lineChart("loss");
  const mfu = lineChart("MFU", { scale: 100, unit: "%" });
  const charts = el("div", { class: "wb-charts" }, [loss.node, mfu.node]);
  function draw() {
    const p = model.get("payload");
    if (!p || !p.processes) { root.replaceChildren(el("div", { class: "wb-note", text: "no job" })); return; }
    if (p.status === "failed") p.processes.forEach((q) => { if (q.state === "failed") open.add(q.index); });
    bar.update(p.target_steps ? p.step / p.target_steps : 0);
    loss.update(p.loss);
    mfu.update(p.mfu);
    root.replaceChildren(...[
      header(p, onStop),
      schedulerLine(p),
      bar.node,
      p.failure ? el("div", { class: "wb-error", text: p.failure }) : null,
      charts,
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
