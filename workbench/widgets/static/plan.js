// Plan widget: tabs. Overview: summary, stacked memory per device with the device limit, FLOPs,
// lints, collectives. Activations: every activation of the step. Collectives: each with its
// source line, tensor and rule; a click asks Python to draw the layouts before and after.
import { colour, el, fmtBytes, legend, table, tooltip } from "./common.js";

const SEVERITY = { error: "#d62728", warning: "#e8a33d", info: "#4e79a7" };

function fmtFlops(x) {
  if (x === null || x === undefined) return "—";
  const units = [["PFLOP", 1e15], ["TFLOP", 1e12], ["GFLOP", 1e9], ["MFLOP", 1e6]];
  for (const [u, s] of units) if (Math.abs(x) >= s) return `${(x / s).toPrecision(3)} ${u}`;
  return `${x.toPrecision(3)} FLOP`;
}

const SOURCES = { "tpu-compiler": "TPU compiler", "cpu-compiler": "CPU compiler", "gpu-compiler": "GPU compiler" };

/** A wb.plan(wait=False) plan: the formula's numbers until the compiler's land, then what changed. */
function background(p) {
  const b = p.background;
  if (!b) return null;
  const lines = [el("div", { class: `wb-note wb-plan-background wb-bg-${b.state}`, text: b.text })];
  if (b.changes.length) {
    lines.push(el("div", { class: "wb-note wb-plan-changes", text: `formula → compiler: ${b.changes.join("; ")}` }));
  }
  return el("div", {}, lines);
}

function header(p) {
  const how = p.compile_cached ? "from the compile cache" : `compiled in ${p.compile_seconds.toFixed(1)} s`;
  const pending = p.background && (p.background.state === "queued" || p.background.state === "compiling");
  const badge = pending
    ? el("span", { class: "wb-badge wb-estimate", text: `FORMULA — ${p.background.state} in the background`, title: p.source_reason })
    : p.estimate
    ? el("span", { class: "wb-badge wb-estimate", text: "ESTIMATE — analytic, nothing compiled", title: p.source_reason })
    : el("span", { class: "wb-badge wb-source", text: `${SOURCES[p.source] || p.source} · ${how}`, title: p.source_reason });
  return el("div", { class: "wb-plan-head" }, [
    el("div", { class: "wb-header" }, [
      el("span", { class: "wb-title", text: `plan ${p.name}` }),
      badge,
      el("span", { class: "wb-facts", text: `batch ${p.batch} × seq ${p.seq} on ${p.mesh_text}` }),
    ]),
    el("div", { class: "wb-note wb-plan-source", text: `source: ${p.source} — ${p.source_reason}` }),
    background(p) || el("span"),
  ]);
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "—";
  if (s >= 1) return `${s.toPrecision(3)} s`;
  if (s >= 1e-3) return `${(s * 1e3).toPrecision(3)} ms`;
  return `${(s * 1e6).toPrecision(3)} µs`;
}

/** How sure the prediction is: 'band 38.1 ms – 45.3 ms per step · MFU 11.2–13.4% · from 3
 * calibration layouts', or 'no band: why' (the band's source as its tooltip). */
function band(pr) {
  const b = pr.band;
  if (!b) return null;
  if (b.low === null || b.high === null) {
    return el("div", { class: "wb-note wb-pred-band wb-pred-noband", text: `no band: ${b.source}` });
  }
  const bits = [`band ${fmtSeconds(pr.step_seconds * b.low)} – ${fmtSeconds(pr.step_seconds * b.high)} per step`];
  if (pr.mfu !== null) bits.push(`MFU ${(pr.mfu / b.high * 100).toFixed(1)}–${(pr.mfu / b.low * 100).toFixed(1)}%`);
  if (pr.tokens_per_s) {
    bits.push(`${Math.round(pr.tokens_per_s / b.high).toLocaleString()}–`
      + `${Math.round(pr.tokens_per_s / b.low).toLocaleString()} tokens/s`);
  }
  bits.push(b.summary);
  return el("div", { class: "wb-note wb-pred-band", text: bits.join(" · "), title: b.source });
}

/** Predicted step: time, bound, MFU, the roofline terms as bars, each collective's time. */
function predicted(p) {
  const pr = p.predicted;
  if (!pr) return el("div", { class: "wb-note", text: "no prediction: the hardware table lacks this device's numbers" });
  const b = pr.breakdown;
  const terms = [["compute", b.compute], ["HBM traffic", b.memory], ["communication", b.communication_total]];
  // activations offloaded to host memory: their trips over the host link (PCIe)
  if (b.host_link) terms.push(["host transfers", b.host_link]);
  // a TPU-compiled plan: local work timed by the compiler's own cycle estimates
  const byCompiler = b.roofline_local !== undefined && b.local !== b.roofline_local;
  if (byCompiler) terms.unshift(["local work (TPU compiler's cycles)", b.local]);
  const top = Math.max(...terms.map((t) => t[1]), pr.step_seconds, 1e-12);
  const facts = [`${fmtSeconds(pr.step_seconds)} per step (${pr.bound}-bound)`];
  if (pr.mfu !== null) facts.push(`MFU ${(pr.mfu * 100).toFixed(1)}%` + (typeof pr.mfu_fp8 === "number"
    ? ` of the bf16 peak, ${(pr.mfu_fp8 * 100).toFixed(1)}% of the fp8 peak` : ""));
  if (pr.tokens_per_s) facts.push(`${Math.round(pr.tokens_per_s).toLocaleString()} tokens/s`);
  if (pr.compiler_seconds !== null) facts.push(`TPU compiler's own estimate ${fmtSeconds(pr.compiler_seconds)}`);
  const bars = terms.map(([name, t]) => el("div", { class: "wb-pred-row" }, [
    el("span", { class: "wb-pred-name", text: name }),
    el("span", { class: "wb-pred-bar", style: { width: `${Math.max(1, (t / top) * 240)}px` },
      title: name === "communication" ? `${fmtSeconds(b.communication)} not hidden behind compute (${pr.sources.overlap})`
        : name === "host transfers" ? `${fmtSeconds(b.host_transfers)} not hidden behind compute: `
          + `${fmtBytes(b.host_bytes_to_host)} to host and ${fmtBytes(b.host_bytes_to_device)} back per step (${pr.sources.host_transfers})`
        : name.startsWith("local work") ? pr.sources.local
        : pr.sources[name === "compute" ? "flops" : "bytes"] + (byCompiler ? " (the roofline's ideal)" : "") }),
    el("span", { class: "wb-pred-value", text: fmtSeconds(t) }),
  ]));
  const rows = b.collectives.map((c) => ({ ...c, axes_text: c.axes.join(", ") || "—",
    gbps: c.bandwidth / 1e9, overlap_text: `${Math.round(c.overlap * 100)}%` }));
  return el("div", { class: "wb-plan-predicted" }, [
    el("div", { class: "wb-subtitle", text: `predicted — ${facts.join(" · ")}` }),
    ...[band(pr)].filter(Boolean),
    ...bars,
    rows.length ? el("div", { class: "wb-scroll" }, [table([
      { key: "kind", label: "collective" },
      { key: "axes_text", label: "mesh axes" },
      { key: "count", label: "count", numeric: true },
      { key: "bytes", label: "bytes each", numeric: true, format: fmtBytes },
      { key: "links", label: "links" },
      { key: "gbps", label: "GB/s", numeric: true, format: (v) => v.toPrecision(3) },
      { key: "seconds", label: "time/step", numeric: true, format: fmtSeconds },
      { key: "overlap_text", label: "hidden" },
    ], rows, { sortKey: "seconds" }).node]) : el("div", { class: "wb-note", text: "no collectives" }),
    el("div", { class: "wb-note", text: `peak FLOP/s: ${pr.sources.peak_flops}; HBM: ${pr.sources.hbm_bandwidth}; overlap: ${pr.sources.overlap}` }),
  ]);
}

/** Distinct per-device stacks (devices with equal bytes share a column) in mesh order. */
function columns(mem) {
  const n = mem.per_device[mem.stack[0]].length;
  const cols = [];
  const seen = new Map();
  for (let i = 0; i < n; i += 1) {
    const parts = mem.stack.map((k) => mem.per_device[k][i]);
    const key = parts.join(",");
    if (n > 64 && seen.has(key)) { seen.get(key).positions.push(i); continue; }
    const col = { parts, positions: [i] };
    seen.set(key, col);
    cols.push(col);
  }
  return cols;
}

function memoryBars(p, tip) {
  const mem = p.memory;
  const cols = columns(mem);
  const totals = cols.map((c) => c.parts.reduce((a, b) => a + b, 0));
  const top = Math.max(mem.limit || 0, ...totals, 1);
  const height = 120;
  const chart = el("div", { class: "wb-plan-bars", style: { height: `${height}px` } });
  cols.forEach((c, ci) => {
    const ids = c.positions.map((i) => p.mesh.device_ids[i]);
    const col = el("div", { class: "wb-plan-col wb-col", "data-group": ids.join(","),
      style: { height: `${(totals[ci] / top) * height}px` } });
    c.parts.forEach((bytes, k) => {
      if (!bytes) return;
      col.appendChild(el("div", { class: "wb-plan-seg", style: {
        height: `${(bytes / top) * height}px`, background: colour(k, mem.stack.length) } }));
    });
    col.addEventListener("mousemove", (e) => tip.show(e, [
      ids.length === 1 ? `device ${ids[0]}` : `${ids.length} devices (${ids.slice(0, 4).join(", ")}…)`,
      ...mem.stack.map((k, i) => `${k}: ${fmtBytes(c.parts[i])}`),
      `total: ${fmtBytes(totals[ci])}`]));
    col.addEventListener("mouseleave", () => tip.hide());
    chart.appendChild(col);
  });
  if (mem.limit) {
    chart.appendChild(el("div", { class: "wb-plan-limit", title: `device memory ${fmtBytes(mem.limit)}`,
      style: { bottom: `${(mem.limit / top) * height}px` } }, [
      el("span", { text: `limit ${fmtBytes(mem.limit)}` })]));
  }
  const fits = mem.fits === null ? "device limit unknown" : mem.fits ? "fits" : "DOES NOT FIT";
  return el("div", { class: "wb-plan-memory" }, [
    el("div", { class: "wb-subtitle", text: `memory per device — total ${fmtBytes(mem.total)} (${fits})` }),
    chart,
    legend("", mem.stack.map((k, i) => [colour(i, mem.stack.length), k])),
    table([
      { key: "key", label: "component" },
      { key: "bytes", label: p.estimate ? "estimate" : "compiled", numeric: true, format: fmtBytes },
      { key: "estimate", label: "by formula", numeric: true, format: fmtBytes },
    ], mem.rows).node,
  ]);
}

function flops(p) {
  const f = p.flops;
  const parts = Object.entries(f.breakdown).map(([k, v]) => `${k} ${((100 * v) / f.model).toFixed(0)}%`);
  const perDev = f.compiled_per_device === null ? `${fmtFlops(f.per_device)} (estimate)`
    : `${fmtFlops(f.compiled_per_device)} (compiled cost analysis)`;
  return el("div", { class: "wb-plan-flops" }, [
    el("div", { class: "wb-subtitle", text: "FLOPs per step" }),
    el("div", { text: `model FLOPs ${fmtFlops(f.model)} (all devices; ${parts.join(", ")}) · 6N·tokens ${fmtFlops(f.six_n)}` }),
    el("div", { text: `per device ${perDev} · replicated compute factor ${f.replicated_compute_factor.toPrecision(3)}` }),
    el("div", { class: "wb-note", text: f.formula }),
  ]);
}

function lints(p) {
  if (!p.warnings.length) return el("div", { class: "wb-note", text: "no lints: the layout looks sound" });
  return el("div", { class: "wb-plan-lints" }, [
    el("div", { class: "wb-subtitle", text: `lints (${p.warnings.length})` }),
    ...p.warnings.map((w) => el("div", { class: "wb-lint", style: { "border-left-color": SEVERITY[w.severity] } }, [
      el("div", {}, [el("b", { text: `${w.severity} · ${w.kind} · ` }), el("code", { text: w.path })]),
      el("div", { text: w.message }),
      el("div", { class: "wb-note", text: `fix: ${w.fix}` }),
    ])),
  ]);
}

function collectives(p) {
  const rows = p.collectives.map((c) => ({ ...c, axes_text: c.axes.join(", ") || "—", shapes_text: c.shapes.slice(0, 3).join(" ") }));
  return el("div", { class: "wb-plan-collectives" }, [
    el("div", { class: "wb-subtitle", text: `collectives — ${fmtBytes(p.comm_bytes_per_device)} sent per device per step${p.estimate ? " (estimate)" : ""}` }),
    el("div", { class: "wb-scroll" }, [table([
      { key: "kind", label: "kind" },
      { key: "axes_text", label: "mesh axes" },
      { key: "count", label: "count", numeric: true },
      { key: "bytes", label: "bytes each", numeric: true, format: fmtBytes },
      { key: "total_wire_bytes", label: "sent/step", numeric: true, format: fmtBytes },
      { key: "group_size", label: "group", numeric: true },
      { key: "shapes_text", label: "shapes" },
    ], rows, { sortKey: "total_wire_bytes" }).node]),
  ]);
}

function fmtSpec(spec) {
  return `P(${spec.map((s) => (s === null ? "?" : s.length ? s.join("+") : "None")).join(", ")})`;
}

/** Activations tab: name, layer, shape, sharding, bytes per device, where it comes from. */
function activations(p) {
  const a = p.activations || { rows: [] };
  if (a.error) return el("div", { class: "wb-note wb-plan-act-error", text: `activations could not be traced: ${a.error}` });
  if (!a.rows.length) return el("div", { class: "wb-note", text: "no activations found (the model constrains none and has no attention)" });
  const rows = a.rows.map((r) => ({ ...r, layer_text: r.layer === null ? (r.count > 1 ? `all ${r.count} (scanned)` : "—") : r.layer,
    shape_text: `${r.dtype}[${r.shape.join(", ")}]`, spec_text: fmtSpec(r.spec),
    logical_text: r.logical.map((x) => x ?? "·").join(", ") }));
  return el("div", { class: "wb-plan-activations" }, [
    el("div", { class: "wb-subtitle", text: `activations — ${rows.length} tensors, ${fmtBytes(a.per_device)} per device if all were live at once` }),
    el("div", { class: "wb-scroll" }, [table([
      { key: "name", label: "activation" },
      { key: "layer_text", label: "layer" },
      { key: "shape_text", label: "shape" },
      { key: "logical_text", label: "logical axes" },
      { key: "spec_text", label: "sharding" },
      { key: "bytes_per_device", label: "bytes/device", numeric: true, format: fmtBytes },
      { key: "source", label: "from" },
    ], rows).node]),
    el("div", { class: "wb-note", text: "constrain: the layout the model asks JAX for (wb.rules.constrain); jaxpr: found in the traced step (attention scores), '?' dims laid out by the compiler" }),
  ]);
}

/** Collectives tab: source line, tensor moved and rule; a click draws before/after layouts. */
function collectivesTab(p, model) {
  const rows = p.collectives.map((c) => ({ ...c, axes_text: c.axes.join(", ") || "—",
    tensor_text: (c.tensors || []).slice(0, 2).join(", ") + ((c.tensors || []).length > 2 ? ` +${c.tensors.length - 2}` : ""),
    source_text: (c.sources || [])[0] || "—", rule_text: c.rule || "—" }));
  const picked = model.get("selected_collective");
  const t = table([
    { key: "kind", label: "kind" },
    { key: "axes_text", label: "mesh axes" },
    { key: "count", label: "count", numeric: true },
    { key: "total_wire_bytes", label: "sent/step", numeric: true, format: fmtBytes },
    { key: "tensor_text", label: "tensor", wrap: true },
    { key: "source_text", label: "source" },
    { key: "rule_text", label: "because", wrap: true },
  ], rows, { sortKey: "total_wire_bytes", onRow: (row) => {
    model.set("selected_collective", row.index);
    model.save_changes();
  } });
  t.highlight((row) => row.index === picked);
  const note = model.get("collective_note");
  return el("div", { class: "wb-plan-collective-tab" }, [
    el("div", { class: "wb-subtitle", text: `collectives — ${p.estimate ? "estimated from the layouts" : "from the compiled program, traced to their source lines"}` }),
    el("div", { class: "wb-scroll" }, [t.node]),
    el("div", { class: "wb-note wb-plan-collective-note", text: picked >= 0 && note ? `drawn below: ${note}` : "click a collective to draw its tensor's layout before and after it" }),
  ]);
}

const TABS = [["overview", "Overview"], ["activations", "Activations"], ["collectives", "Collectives"]];

function render({ model, el: host }) {
  const root = el("div", { class: "wb-widget wb-plan" });
  host.appendChild(root);
  function draw() {
    const p = model.get("payload");
    if (!p || !p.memory) { root.replaceChildren(el("div", { class: "wb-note", text: "empty plan" })); return; }
    const tip = tooltip(root);
    const current = TABS.some(([k]) => k === model.get("tab")) ? model.get("tab") : "overview";
    const tabs = el("div", { class: "wb-tabs" }, TABS.map(([name, label]) => el("button", {
      class: `wb-tab${current === name ? " wb-active" : ""}`, text: label, "data-tab": name,
      onclick: () => { model.set("tab", name); model.save_changes(); },
    })));
    const body = current === "activations" ? [activations(p)]
      : current === "collectives" ? [collectivesTab(p, model)]
        : [memoryBars(p, tip), flops(p), predicted(p), lints(p), collectives(p)];
    root.replaceChildren(header(p), tabs, ...body, tip.node);
  }
  draw();
  const names = ["payload", "tab", "selected_collective", "collective_note"];
  for (const name of names) model.on(`change:${name}`, draw);
  return () => { for (const name of names) model.off(`change:${name}`, draw); };
}

export default { render };
