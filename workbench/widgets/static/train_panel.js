// Train panel: the live view of Trainer.run in its cell — progress and ETA, loss (and the
// held-out loss) and MFU curves, and where the step time goes (compute, data, checkpoint).
// Its helpers come from common.js, inlined by workbench/widgets/_assets.py for anywidget.
//
// Model state: `info` {name, run_dir, peak_source, model_flops, prediction}, where
// `prediction` is the plan's (checked by Python: finite numbers or absent; null for runs
// not started from a plan) {step_seconds, mfu, bound, source, ...}; `status` {step, target,
// eta, state, message, last}; `history` {step: [...], loss: [...], ...} (the whole run,
// read from the run directory by Python). Live rows arrive as custom messages
// {type: "append", rows: [[step, loss, mfu, step_time, data_time, ckpt_time, eval_loss], ...]}
// (eval_loss null except at evaluation steps: drawn dashed beside the training loss),
// batched by Python to at most 10 per second. Nodes are built once and updated in place.
// A restarted run (Trainer(..., restart="ok")) also has `history.attempts`: its earlier
// attempts [{attempt, step: [...], loss: [...], mfu: [...]}], drawn faint ("attempt 1")
// beside the current one (`history.attempt`).

import { el, fmtNum, lineChart, progressBar } from "./common.js";

const COLS = ["step", "loss", "mfu", "step_time", "data_time", "ckpt_time", "eval_loss"];
const MAX_POINTS = 1200;

/** 62.4 -> "1:02", 3725 -> "1:02:05". */
export function duration(seconds) {
  if (typeof seconds !== "number" || !Number.isFinite(seconds)) return "?";
  const s = Math.round(seconds);
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const r = String(s % 60).padStart(2, "0");
  return h ? `${h}:${String(m).padStart(2, "0")}:${r}` : `${m}:${r}`;
}

/** Every k-th point so that at most `max` are drawn (the last one always kept). */
export function thin(xs, ys, max = MAX_POINTS) {
  const pts = [];
  for (let i = 0; i < xs.length; i += 1) {
    if (typeof ys[i] === "number" && Number.isFinite(ys[i])) pts.push([xs[i], ys[i]]);
  }
  if (pts.length <= max) return pts;
  const stride = Math.ceil(pts.length / max);
  const out = pts.filter((_, i) => i % stride === 0);
  if (out[out.length - 1] !== pts[pts.length - 1]) out.push(pts[pts.length - 1]);
  return out;
}

/** A finite positive number, else null (a prediction field from a hand-edited run.json). */
function positive(v) {
  return typeof v === "number" && Number.isFinite(v) && v > 0 ? v : null;
}

/** "predicted 10.0 ms, measured 1.23× that" or "" without a prediction. */
export function predictedText(measured, predicted) {
  const p = positive(predicted);
  if (p === null) return "";
  const text = `predicted ${(1000 * p).toFixed(1)} ms`;
  const m = positive(measured);
  return m === null ? text : `${text}, measured ${Number((m / p).toPrecision(3))}× that`;
}

/** Mean of the last `n` finite values of a column. */
function recentMean(values, n = 20) {
  const tail = values.slice(-n).filter((v) => typeof v === "number" && Number.isFinite(v));
  return tail.length ? tail.reduce((a, b) => a + b, 0) / tail.length : null;
}

/** Step time split into compute, data wait and checkpoint blocking (recent means). */
function breakdown(prediction) {
  const parts = [["compute", "#4e79a7"], ["data", "#f28e2b"], ["checkpoint", "#e15759"]];
  const bar = el("div", { class: "wb-train-stack" });
  const segs = parts.map(([name, colour]) => {
    const seg = el("div", { class: `wb-train-seg wb-train-${name}`, title: name });
    seg.style.setProperty("background", colour);
    bar.appendChild(seg);
    return seg;
  });
  const text = el("div", { class: "wb-train-times" });
  const node = el("div", { class: "wb-train-breakdown" }, [bar, text]);
  function update(cols) {
    const total = recentMean(cols.step_time);
    const data = recentMean(cols.data_time) || 0;
    const ckpt = recentMean(cols.ckpt_time) || 0;
    const pred = predictedText(total, prediction().step_seconds);
    if (total === null) {
      text.textContent = "step time: waiting for the first step…" + (pred ? ` (${pred})` : "");
      return;
    }
    const compute = Math.max(0, total - data - ckpt);
    [compute, data, ckpt].forEach((v, i) => segs[i].style.setProperty("width", `${(100 * v / total).toFixed(1)}%`));
    const ms = (v) => `${(1000 * v).toFixed(1)} ms`;
    text.textContent = `step time ${ms(total)} (mean of last 20${pred ? `; ${pred}` : ""}): ` +
      `compute ${ms(compute)} · data ${ms(data)} · checkpoint ${ms(ckpt)}`;
  }
  return { node, update };
}

function render({ model, el: host }) {
  const cols = Object.fromEntries(COLS.map((c) => [c, []]));
  const title = el("span", { class: "wb-title" });
  const badge = el("span", { class: "wb-status" });
  const facts = el("span", { class: "wb-facts" });
  const bar = progressBar();
  const loss = lineChart("loss");
  const mfu = lineChart("MFU", { scale: 100, unit: "%" });
  const prediction = () => {
    const p = (model.get("info") || {}).prediction;
    return p && typeof p === "object" ? p : {};
  };
  const times = breakdown(prediction);
  const note = el("div", { class: "wb-note" });
  const message = el("div", { class: "wb-train-message" });
  const root = el("div", { class: "wb-widget wb-train" }, [
    el("div", { class: "wb-header" }, [title, badge, facts]), bar.node,
    el("div", { class: "wb-charts" }, [loss.node, mfu.node]), times.node, message, note]);
  host.appendChild(root);

  let earlier = [];
  let current = "";
  function loadHistory() {
    const h = model.get("history") || {};
    for (const c of COLS) cols[c] = Array.isArray(h[c]) ? h[c].slice() : [];
    earlier = Array.isArray(h.attempts) ? h.attempts.filter((a) => a && Array.isArray(a.step)) : [];
    current = earlier.length ? `attempt ${h.attempt}` : "";
  }
  /** The earlier attempts' curves of one column, named for the chart's label. */
  function attempts(col) {
    return earlier.map((a) => ({ name: `attempt ${a.attempt}`,
      points: thin(a.step, Array.isArray(a[col]) ? a[col] : []) }));
  }
  function draw() {
    const info = model.get("info") || {};
    const st = model.get("status") || {};
    const step = st.step ?? (cols.step.length ? cols.step[cols.step.length - 1] : 0);
    const target = st.target || 0;
    title.textContent = `train ${info.name || ""}`;
    badge.textContent = st.state || "idle";
    badge.className = `wb-status wb-${st.state || "idle"}`;
    const last = st.last || {};
    const bits = [`step ${step}/${target}`, `ETA ${duration(st.eta)}`, `loss ${fmtNum(last.loss)}`];
    const predMfu = positive(prediction().mfu);
    if (typeof last.mfu === "number") {
      bits.push(`MFU ${fmtNum(100 * last.mfu, 3)}%` +
        (predMfu === null ? "" : ` (pred. ${fmtNum(100 * predMfu, 3)}%)`) +
        (typeof last.mfu_fp8 === "number" ? ` of the bf16 peak, ${fmtNum(100 * last.mfu_fp8, 3)}% of the fp8 peak` : ""));
    } else if (predMfu !== null) {
      bits.push(`MFU pred. ${fmtNum(100 * predMfu, 3)}%`);
    }
    if (typeof last.tokens_per_s === "number") bits.push(`${fmtNum(last.tokens_per_s / 1e3, 3)}k tok/s`);
    facts.textContent = bits.join(" · ");
    bar.update(target ? step / target : 0);
    loss.update(thin(cols.step, cols.loss), thin(cols.step, cols.eval_loss), "eval",
      attempts("loss"), current);
    mfu.update(thin(cols.step, cols.mfu), [], "", attempts("mfu"), current);
    times.update(cols);
    message.textContent = st.message || "";
    note.textContent = `run directory ${info.run_dir || "?"}` +
      (info.peak_source ? ` · MFU = model FLOPs ÷ (step time × devices × peak); peak ${info.peak_source}` : "");
  }
  function onMessage(msg) {
    if (!msg || msg.type !== "append") return;
    const lastStep = cols.step.length ? cols.step[cols.step.length - 1] : -Infinity;
    for (const row of msg.rows || []) {
      if (row[0] <= lastStep) continue;  // already in the history
      COLS.forEach((c, i) => cols[c].push(row[i]));
    }
    draw();
  }
  function onHistory() { loadHistory(); draw(); }
  loadHistory();
  draw();
  model.on("change:history", onHistory);
  model.on("change:status", draw);
  model.on("msg:custom", onMessage);
  return () => {
    model.off("change:history", onHistory);
    model.off("change:status", draw);
    model.off("msg:custom", onMessage);
  };
}

export default { render };
