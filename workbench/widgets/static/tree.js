// Pytree widget: a sortable table of tensors, per-device memory bars, and a treescope tab.
import { colour, el, fmtBytes, fmtShape, select, table, tooltip, unravel } from "./common.js";

const BAR_LIMIT = 64; // up to this many devices: one bar each; above: grouped by a mesh axis

export const COLUMNS = [
  { key: "path", label: "path" },
  { key: "shape", label: "shape", format: (s) => fmtShape(s) },
  { key: "dtype", label: "dtype" },
  { key: "spec", label: "spec" },
  { key: "logical", label: "logical axes", wrap: true, format: (l) => (l ? `(${l.map((a) => a ?? "None").join(", ")})` : "—") },
  { key: "bytes", label: "bytes / device", numeric: true, format: fmtBytes },
  { key: "replication", label: "replicas", numeric: true, format: (r) => (r === null ? "—" : `×${r}`) },
  { key: "total", label: "total", numeric: true, format: fmtBytes },
  { key: "note", label: "note", wrap: true, format: (n) => n || "" },
];

/** The columns worth showing: logical axes and notes only when some row has them. */
export function columnsFor(rows) {
  return COLUMNS.filter((c) => (c.key !== "logical" && c.key !== "note") || rows.some((r) => r[c.key]));
}

/** Per-device bytes grouped by the coordinate along mesh axis `axis`: [{label, max, min, n}]. */
export function groupMemory(mesh, memory, axis) {
  const k = mesh.axis_names.indexOf(axis);
  const n = mesh.axis_sizes[k];
  const groups = [...Array(n).keys()].map((c) => ({ label: `${axis}=${c}`, max: 0, min: Infinity, n: 0 }));
  memory.forEach((bytes, pos) => {
    const g = groups[unravel(pos, mesh.axis_sizes)[k]];
    g.max = Math.max(g.max, bytes);
    g.min = Math.min(g.min, bytes);
    g.n += 1;
  });
  return groups;
}

/** Memory bars: one per device when few, else per coordinate of a chosen mesh axis. */
export function memoryBars(root, p, axis, onAxis) {
  const m = p.mesh;
  const tip = tooltip(root);
  const cap = m.memory_per_device;
  const peak = Math.max(1, ...p.memory);
  const low = Math.min(...p.memory);
  const share = cap ? `; max is ${((100 * peak) / cap).toPrecision(2)}% of ${fmtBytes(cap)} per device` : "";
  const spread = low === peak ? `all ${m.size} devices hold ${fmtBytes(peak)}` : `${fmtBytes(low)} to ${fmtBytes(peak)}`;
  const title = `parameter memory per device: ${spread}${share}`;
  if (m.size <= BAR_LIMIT) {
    const bars = p.memory.map((bytes, pos) => el("div", { class: "wb-bar-row", "data-device": m.device_ids[pos] }, [
      el("span", { class: "wb-bar-label", text: `${m.device_ids[pos]}` }),
      el("span", { class: "wb-bar-track" }, [el("span", {
        class: "wb-bar", style: { width: `${(100 * bytes) / peak}%`, background: colour(0, 1) },
      })]),
      el("span", { class: "wb-bar-value", text: fmtBytes(bytes) }),
    ]));
    return el("div", { class: "wb-memory" }, [el("div", { class: "wb-subtitle", text: title }), ...bars, tip.node]);
  }
  const groups = groupMemory(m, p.memory, axis);
  const width = Math.max(2, Math.min(24, Math.floor(560 / groups.length)));
  const cols = groups.map((g) => el("div", {
    class: "wb-col", "data-group": g.label,
    style: { width: `${width}px`, height: `${(100 * g.max) / peak}%`, background: colour(0, 1) },
    onmousemove: (e) => tip.show(e, [g.label, `max ${fmtBytes(g.max)}, min ${fmtBytes(g.min)} over ${g.n} devices`]),
    onmouseleave: () => tip.hide(),
  }));
  const axes = m.axis_names.map((a, i) => [a, `${a} (${m.axis_sizes[i]})`]);
  return el("div", { class: "wb-memory" }, [
    el("div", { class: "wb-subtitle", text: title }),
    el("div", { class: "wb-controls" }, [select("one column per", axes, axis, onAxis),
      el("span", { class: "wb-note", text: `${m.size} devices; a column shows the most loaded device of its group` })]),
    el("div", { class: "wb-columns" }, cols),
    tip.node,
  ]);
}

function whereMax(t, size) {
  if (t.max_count === size) return `all ${size} devices`;
  const more = t.max_count - t.max_devices.length;
  return `device ${t.max_devices.join(", ")}${more > 0 ? ` and ${more} more` : ""}`;
}

function header(p) {
  const t = p.totals;
  const facts = [
    `${t.tensors} tensor${t.tensors === 1 ? "" : "s"}`, `${t.params.toLocaleString("en-US")} parameters`,
    `total ${fmtBytes(t.bytes)}`, `max per device ${fmtBytes(t.max_device_bytes)} (${whereMax(t, p.mesh.size)})`,
    `mesh ${p.mesh.axis_names.map((a, i) => `${a}=${p.mesh.axis_sizes[i]}`).join(" × ")}`,
  ];
  return el("div", { class: "wb-header" }, [
    el("span", { class: "wb-title", text: p.title }), el("span", { class: "wb-facts", text: facts.join(" · ") }),
  ]);
}

function tableTab(root, p, model) {
  const filter = el("input", { type: "search", class: "wb-filter", placeholder: "filter paths", "aria-label": "filter paths" });
  const tab = table(columnsFor(p.rows), p.rows, {
    onRow: (row) => { model.set("selected", row.path); model.save_changes(); },
  });
  const mark = () => tab.highlight((row) => row.path === model.get("selected"));
  filter.addEventListener("input", () => {
    const q = filter.value.toLowerCase();
    tab.setRows(q ? p.rows.filter((r) => r.path.toLowerCase().includes(q)) : p.rows);
    mark();
  });
  mark();
  const hint = el("div", { class: "wb-note", text: "click a row to draw its layout below; click a header to sort" });
  return { node: el("div", {}, [filter, hint, el("div", { class: "wb-scroll" }, [tab.node])]), mark };
}

function treescopeTab(model) {
  const html = model.get("treescope_html");
  if (!html) return el("div", { class: "wb-note", text: "rendering the tree with treescope…" });
  return el("iframe", { class: "wb-treescope", srcdoc: html, sandbox: "allow-scripts", title: "treescope" });
}

function render({ model, el: host }) {
  const root = el("div", { class: "wb-widget wb-tree" });
  host.appendChild(root);
  let marker = null;
  function draw() {
    const p = model.get("payload");
    if (!p || !p.rows) { root.replaceChildren(el("div", { class: "wb-note", text: "empty tree" })); return; }
    const current = model.get("tab") === "tree" ? "tree" : "table";
    const tabButton = (name, label) => el("button", {
      class: `wb-tab${current === name ? " wb-active" : ""}`, text: label, "data-tab": name,
      onclick: () => {
        model.set("tab", name);
        if (name === "tree") model.set("want_treescope", true);
        model.save_changes();
      },
    });
    const tabs = el("div", { class: "wb-tabs" }, [tabButton("table", "Table"), tabButton("tree", "Tree (treescope)")]);
    let body;
    if (current === "table") {
      const t = tableTab(root, p, model);
      marker = t.mark;
      const axis = p.mesh.axis_names.includes(model.get("group_axis")) ? model.get("group_axis") : p.mesh.axis_names[0];
      const bars = memoryBars(root, p, axis, (v) => { model.set("group_axis", v); model.save_changes(); });
      body = el("div", {}, [t.node, bars]);
    } else {
      marker = null;
      body = treescopeTab(model);
    }
    root.replaceChildren(header(p), tabs, body);
  }
  const onSelected = () => { if (marker) marker(); };
  draw();
  const names = ["payload", "tab", "treescope_html", "group_axis"];
  for (const name of names) model.on(`change:${name}`, draw);
  model.on("change:selected", onSelected);
  return () => {
    for (const name of names) model.off(`change:${name}`, draw);
    model.off("change:selected", onSelected);
  };
}

export default { render };
