// Layout widget: the blocks of one tensor across the mesh, two dims drawn, others as panels.
import {
  colour, el, fmtBytes, fmtIds, fmtRanges, fmtShape, legend, select, stripes, tooltip, unravel,
} from "./common.js";

const MAX_MULTIPLES = 16; // more panels than this: one panel and a slider
const LABEL_BLOCKS = 64; // label blocks with device ids when a panel has at most this many

/** Default [row dim, column dim]: the two most-split dims, in tensor order (-1 = none). */
export function defaultDims(p) {
  const r = p.shape.length;
  if (r === 0) return [-1, -1];
  if (r === 1) return [-1, 0];
  const order = [...Array(r).keys()].sort((a, b) => p.partitions[b] - p.partitions[a] || b - a);
  const two = order.slice(0, 2).sort((a, b) => a - b);
  return two;
}

/** Valid dims from the trait, else the default. */
export function chooseDims(p, dims) {
  const r = p.shape.length;
  const ok = Array.isArray(dims) && dims.length === 2 && dims[1] >= 0 && dims[1] < r
    && dims[0] < r && dims[0] !== dims[1] && (dims[0] >= 0 || r === 1);
  return ok ? dims : defaultDims(p);
}

/** Group the blocks into panels: one per distinct range of the dims not drawn. */
export function panels(p, dims) {
  const others = [...Array(p.shape.length).keys()].filter((d) => !dims.includes(d));
  const byKey = new Map();
  p.blocks.forEach((b, index) => {
    const key = others.map((d) => `${b.start[d]}:${b.stop[d]}`).join(",");
    if (!byKey.has(key)) byKey.set(key, { key, others, start: others.map((d) => b.start[d]), stop: others.map((d) => b.stop[d]), blocks: [] });
    byKey.get(key).blocks.push(index);
  });
  return [...byKey.values()].sort((a, b) => {
    for (let i = 0; i < a.start.length; i += 1) if (a.start[i] !== b.start[i]) return a.start[i] - b.start[i];
    return 0;
  });
}

/** Colour modes for this payload, and the default. */
export function colourModes(p) {
  const m = p.mesh;
  const opts = [["group", `replica group (${p.num_shards})`]];
  if (m.size <= 32) opts.unshift(["device", `device (${m.size})`]);
  m.axis_names.forEach((a, i) => opts.push([`axis:${a}`, `mesh axis ${a} (${m.axis_sizes[i]})`]));
  if (m.process_index && m.n_hosts > 1) opts.push(["host", `host (${m.n_hosts})`]);
  return opts;
}

export function defaultMode(p, dims) {
  if (p.mesh.size <= 16) return "device";
  if (p.num_shards <= 16) return "group";
  for (const d of dims) if (d >= 0 && p.spec[d].length) return `axis:${p.spec[d][0]}`;
  return "group";
}

/** Colours of the devices (as mesh positions) holding block `b` under `mode`. */
export function blockColours(p, mode, b, index) {
  const m = p.mesh;
  if (mode === "group") return [colour(index, p.blocks.length)];
  if (mode === "device") return b.positions.map((pos) => colour(pos, m.size));
  if (mode === "host") return b.positions.map((pos) => colour(m.process_index[pos], m.n_hosts));
  const axis = m.axis_names.indexOf(mode.slice(5));
  return b.positions.map((pos) => colour(unravel(pos, m.axis_sizes)[axis], m.axis_sizes[axis]));
}

function modeLegend(p, mode) {
  const m = p.mesh;
  if (mode === "group") return legend("replica group", p.blocks.map((b, i) => [colour(i, p.blocks.length), `${i}`]));
  if (mode === "device") return legend("device", m.device_ids.map((id, pos) => [colour(pos, m.size), `${id}`]));
  if (mode === "host") return legend("host", [...Array(m.n_hosts).keys()].map((h) => [colour(h, m.n_hosts), `${h}`]));
  const axis = m.axis_names.indexOf(mode.slice(5));
  const n = m.axis_sizes[axis];
  return legend(`${m.axis_names[axis]} =`, [...Array(n).keys()].map((c) => [colour(c, n), `${c}`]));
}

/** Which tensor dim each mesh axis splits, for the legend. */
function axesLegend(p) {
  const m = p.mesh;
  const items = m.axis_names.map((a, i) => {
    const dim = p.spec.findIndex((axes) => axes.includes(a));
    const where = dim < 0 ? "replicates" : `splits dim ${dim}`;
    return el("span", { class: "wb-axis" }, [el("b", { text: `${a}` }), ` (${m.axis_sizes[i]}) ${where}`]);
  });
  return el("div", { class: "wb-legend" }, [el("span", { class: "wb-legend-title", text: "mesh axes" }), ...items]);
}

function blockTip(p, b, index) {
  const m = p.mesh;
  const ids = b.positions.map((pos) => m.device_ids[pos]);
  const lines = [`block ${index}: device${ids.length > 1 ? "s" : ""} ${fmtIds(ids)}`];
  if (ids.length <= 4) {
    for (const pos of b.positions) {
      const c = unravel(pos, m.axis_sizes);
      const host = m.process_index ? ` host ${m.process_index[pos]}` : "";
      lines.push(`  ${m.device_ids[pos]}: ${m.axis_names.map((a, k) => `${a}=${c[k]}`).join(" ")}${host}`);
    }
  }
  const held = b.stop.map((s, d) => s - b.start[d]);
  lines.push(`index ${fmtRanges(b.start, b.stop)}`);
  const padded = held.some((h, d) => h !== p.shard_shape[d]);
  lines.push(`shard shape ${fmtShape(held)}${padded ? ` (allocated ${fmtShape(p.shard_shape)})` : ""}`);
  lines.push(`${fmtBytes(b.bytes)} per device${ids.length > 1 ? `, ${ids.length} replicas` : ""}`);
  return lines;
}

function panelBox(p, dims, panel, mode, tip, size) {
  const [dy, dx] = dims;
  const rows = dy < 0 ? 1 : p.shape[dy] || 1;
  const cols = p.shape[dx] || 1;
  // Block borders only where blocks are wide (tall) enough to see between them.
  const lines = [dx >= 0 && size[0] / p.partitions[dx] >= 4 ? "wb-lines-x" : "",
    dy >= 0 && size[1] / p.partitions[dy] >= 4 ? "wb-lines-y" : ""].join(" ");
  const box = el("div", { class: `wb-panel-box ${lines}`, style: { width: `${size[0]}px`, height: `${size[1]}px` } });
  const labelled = panel.blocks.length <= LABEL_BLOCKS;
  for (const index of panel.blocks) {
    const b = p.blocks[index];
    const y0 = dy < 0 ? 0 : b.start[dy] / rows;
    const y1 = dy < 0 ? 1 : b.stop[dy] / rows;
    const x0 = dx < 0 ? 0 : b.start[dx] / cols;
    const x1 = dx < 0 ? 1 : b.stop[dx] / cols;
    if (x1 <= x0 || y1 <= y0) continue; // an empty edge block (all padding)
    const ids = b.positions.map((pos) => p.mesh.device_ids[pos]);
    const text = blockTip(p, b, index);
    const big = (x1 - x0) * size[0] > 34 && (y1 - y0) * size[1] > 16;
    box.appendChild(el("div", {
      class: "wb-block",
      "data-block": index,
      "data-devices": ids.join(","),
      style: {
        left: `${(100 * x0).toFixed(4)}%`, top: `${(100 * y0).toFixed(4)}%`,
        width: `${(100 * (x1 - x0)).toFixed(4)}%`, height: `${(100 * (y1 - y0)).toFixed(4)}%`,
        background: stripes(blockColours(p, mode, b, index)),
      },
      onmousemove: (e) => tip.show(e, text),
      onmouseleave: () => tip.hide(),
    }, labelled && big ? [el("span", { class: "wb-block-label", text: fmtIds(ids, 4) })] : []));
  }
  return box;
}

/** Pixel size of one panel: proportional to the drawn dims, aspect clamped to stay visible. */
function panelSize(p, dims, count) {
  const [dy, dx] = dims;
  const extent = (d) => (d < 0 ? 1 : Math.max(1, p.shape[d]));
  const ratio = Math.min(2, Math.max(1 / 4, extent(dy) / extent(dx)));
  let w = count <= 1 ? 560 : Math.max(130, 560 / Math.min(count, 4));
  let h = dy < 0 ? 48 : w * ratio;
  const hMax = count <= 1 ? 280 : 160;
  if (h > hMax) { w *= hMax / h; h = hMax; }
  return [Math.round(w), Math.max(24, Math.round(h))];
}

function panelTitle(p, panel) {
  return panel.others.map((d, i) => `dim ${d} ∈ [${panel.start[i]}:${panel.stop[i]}]`).join(", ");
}

function axisLabel(p, d) {
  if (d < 0) return "";
  const axes = p.spec[d].length ? ` split by ${p.spec[d].join(" × ")}` : " whole";
  return `dim ${d} (${p.shape[d]})${axes}`;
}

/** Draw payload `p` into nodes: controls are wired to `state` (dims, mode, panel, set). */
export function drawLayout(root, p, state) {
  const tip = tooltip(root);
  const { dims, mode } = state;
  const groups = panels(p, dims);
  const slider = groups.length > MAX_MULTIPLES;
  const shown = slider ? [groups[Math.min(Math.max(0, state.panel), groups.length - 1)]] : groups;
  const size = panelSize(p, dims, shown.length);
  const [dy, dx] = dims;
  const multiple = shown.length > 1 || slider;
  const grid = el("div", { class: "wb-panels" }, shown.map((panel) => el("div", { class: "wb-panel" }, [
    multiple ? el("div", { class: "wb-panel-title", text: panelTitle(p, panel) }) : null,
    panelBox(p, dims, panel, mode, tip, size),
  ])));
  const axes = el("div", { class: "wb-axes-note" }, [
    dy >= 0 ? el("span", { text: `rows ↓ ${axisLabel(p, dy)}` }) : null,
    el("span", { text: dx < 0 ? "a scalar: one block" : `columns → ${axisLabel(p, dx)}` }),
    !multiple && groups[0].others.length ? el("span", { text: `(${panelTitle(p, groups[0])}: whole)` }) : null,
  ]);
  const nodes = [axes, grid];
  if (slider) {
    const idx = groups.indexOf(shown[0]);
    const range = el("input", { type: "range", min: 0, max: groups.length - 1, value: idx, class: "wb-slider", "aria-label": "panel" });
    range.addEventListener("input", () => state.set("panel", Number(range.value)));
    nodes.unshift(el("label", { class: "wb-control wb-slider-row" }, [
      `${groups.length} panels over the other dims: `, range, ` ${idx + 1}/${groups.length}`]));
  }
  const empty = p.blocks.filter((b) => b.bytes === 0).flatMap((b) => b.positions.map((pos) => p.mesh.device_ids[pos]));
  if (empty.length) {
    nodes.push(el("div", { class: "wb-note", text: `uneven split: blocks holding only padding: devices ${fmtIds(empty, 12)}` }));
  }
  nodes.push(axesLegend(p), modeLegend(p, mode), tip.node);
  return nodes;
}

function header(p) {
  const spec = `P(${p.spec.map((a) => (a.length === 0 ? "None" : a.length === 1 ? `'${a[0]}'` : `(${a.map((x) => `'${x}'`).join(", ")})`)).join(", ")})`;
  const facts = [
    `${p.dtype}${fmtShape(p.shape)}`, spec,
    `shard ${fmtShape(p.shard_shape)} = ${fmtBytes(p.padded_bytes_per_device)} per device`,
    `${p.num_shards} block${p.num_shards === 1 ? "" : "s"} × ${p.replication} replica${p.replication === 1 ? "" : "s"}`,
    `total ${fmtBytes(p.total_bytes)}`,
  ];
  if (p.logical_axes) facts.push(`logical (${p.logical_axes.map((a) => a ?? "None").join(", ")})`);
  if (p.padding_waste) facts.push(`padding waste ${fmtBytes(p.padding_waste)}`);
  return el("div", { class: "wb-header" }, [
    el("span", { class: "wb-title", text: p.name }), el("span", { class: "wb-facts", text: facts.join(" · ") }),
  ]);
}

function controls(p, state) {
  const r = p.shape.length;
  const dimOpts = [...Array(r).keys()].map((d) => [d, `dim ${d} (${p.shape[d]})`]);
  const [dy, dx] = state.dims;
  const pick = (which) => (v) => {
    const next = [...state.dims];
    next[which] = Number(v);
    if (next[0] === next[1]) next[1 - which] = state.dims[which];
    state.set("dims", next);
  };
  return el("div", { class: "wb-controls" }, [
    r >= 2 ? select("rows", dimOpts, dy, pick(0)) : null,
    r >= 2 ? select("columns", dimOpts, dx, pick(1)) : null,
    select("colour by", colourModes(p), state.mode, (v) => state.set("color_by", v)),
  ]);
}

function render({ model, el: host }) {
  const root = el("div", { class: "wb-widget wb-layout" });
  host.appendChild(root);
  const set = (name, value) => { model.set(name, value); model.save_changes(); };
  function draw() {
    const p = model.get("payload");
    if (!p || !p.shape) {
      root.replaceChildren(el("div", { class: "wb-note", text: model.get("placeholder") || "no layout" }));
      return;
    }
    const dims = chooseDims(p, model.get("dims"));
    let mode = model.get("color_by");
    if (!colourModes(p).some(([v]) => v === mode)) mode = defaultMode(p, dims);
    const state = { dims, mode, panel: model.get("panel"), set };
    root.replaceChildren(header(p), controls(p, state), ...drawLayout(root, p, state));
  }
  draw();
  const names = ["payload", "dims", "color_by", "panel", "placeholder"];
  for (const name of names) model.on(`change:${name}`, draw);
  return () => { for (const name of names) model.off(`change:${name}`, draw); };
}

export default { render };
