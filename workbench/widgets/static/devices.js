// Devices widget: the device inventory as a sortable table, with a per-kind summary.
import { el, fmtBytes, table } from "./common.js";

export const COLUMNS = [
  { key: "id", label: "id", numeric: true },
  { key: "kind", label: "kind" },
  { key: "platform", label: "platform" },
  { key: "process_index", label: "process", numeric: true },
  { key: "coords", label: "coords", format: (c) => (c ? `(${c.join(", ")})` : "—") },
  { key: "core_on_chip", label: "core", numeric: true, format: (c) => (c === null || c === undefined ? "—" : `${c}`) },
  { key: "memory_bytes", label: "memory", numeric: true, format: fmtBytes },
  { key: "host", label: "host", format: (h) => h || "—" },
];

function summary(p) {
  const s = p.summary;
  const peak = s.peak_flops ? `peak ${(s.peak_flops / 1e12).toPrecision(3)} TFLOP/s per device (${s.peak_source})` : null;
  const facts = [`${s.count} device${s.count === 1 ? "" : "s"}`, s.kinds.join(", "), `${s.processes} process${s.processes === 1 ? "" : "es"}`, peak];
  return el("div", { class: "wb-header" }, [
    el("span", { class: "wb-title", text: "devices" }),
    el("span", { class: "wb-facts", text: facts.filter((x) => x).join(" · ") }),
  ]);
}

function render({ model, el: host }) {
  const root = el("div", { class: "wb-widget wb-devices" });
  host.appendChild(root);
  function draw() {
    const p = model.get("payload");
    if (!p || !p.rows) { root.replaceChildren(el("div", { class: "wb-note", text: "no devices" })); return; }
    const t = table(COLUMNS, p.rows, {});
    root.replaceChildren(summary(p), el("div", { class: "wb-scroll" }, [t.node]));
  }
  draw();
  model.on("change:payload", draw);
  return () => model.off("change:payload", draw);
}

export default { render };
