// Mesh widget: a grid of devices labelled with id, mesh coordinates, host, chip coords and the
// core on the chip (TPU v2/v3 and TPU7x chips hold 2 TensorCores, each a JAX device).
import { colour, el, fmtBytes, ink, legend, select, tooltip, unravel } from "./common.js";

const GRID_WIDTH = 760; // px available to the grid
const MAX_CELL = 160; // px: cells never wider than this

/** Every way to put some mesh axes on rows and the rest on columns (mesh order kept). */
export function gridChoices(names, sizes) {
  const k = names.length;
  const out = [];
  for (let mask = 1; mask < (1 << k) - 1; mask += 1) {
    const rowAxes = [...Array(k).keys()].filter((i) => mask & (1 << (k - 1 - i)));
    const colAxes = [...Array(k).keys()].filter((i) => !rowAxes.includes(i));
    const prod = (axes) => axes.reduce((a, i) => a * sizes[i], 1);
    const prefix = rowAxes.every((a, i) => a === i);
    out.push({ rowAxes, colAxes, rows: prod(rowAxes), cols: prod(colAxes), wrap: false, prefix,
      key: rowAxes.map((i) => names[i]).join(",") });
  }
  return out;
}

/** The grid: `rows` names the row axes ("data" or "data,model"); "" picks a wide grid.
 * Small meshes keep the mesh order (first axes on rows); larger ones may be transposed. */
export function gridSplit(names, sizes, rows) {
  const n = sizes.reduce((a, b) => a * b, 1);
  if (names.length === 1) {
    const cols = Math.min(n, n > 256 ? 128 : 32);
    return { rowAxes: [], colAxes: [0], rows: Math.ceil(n / cols), cols, wrap: true, key: "" };
  }
  const choices = gridChoices(names, sizes);
  const asked = choices.find((c) => c.key === rows);
  if (asked) return asked;
  let best = null;
  let bestScore = Infinity;
  for (const c of choices) {
    if (n <= 16 && !c.prefix) continue;
    const score = Math.abs(Math.log(c.cols / c.rows) - Math.log(3)) - (c.prefix ? 1e-6 : 0);
    if (score < bestScore) { bestScore = score; best = c; }
  }
  return best;
}

/** Grid (row, col) of the device at flat mesh position `flat` with mesh coordinate `coord`. */
export function gridCell(coord, sizes, grid, flat) {
  if (grid.wrap) return [Math.floor(flat / grid.cols), flat % grid.cols];
  const rav = (axes) => axes.reduce((acc, i) => acc * sizes[i] + coord[i], 0);
  return [rav(grid.rowAxes), rav(grid.colAxes)];
}

/** Colour options: each mesh axis, hosts when there are several, devices when few. */
export function colourOptions(p) {
  const opts = p.axis_names.map((a, i) => [`axis:${a}`, `${a} (${p.axis_sizes[i]})`]);
  if (p.process_index && p.n_hosts > 1) opts.push(["host", `host (${p.n_hosts})`]);
  if (p.cores) opts.push(["chip", `chip (${nChips(p)})`]);
  if (p.size <= 32) opts.push(["device", "device"]);
  return opts;
}

/** Chips of a mesh whose chips hold several devices (TPU v2/v3, TPU7x: 2 TensorCores). */
function nChips(p) {
  return p.chips ? Math.max(...p.chips) + 1 : p.size;
}

function defaultColour(p) {
  return p.process_index && p.n_hosts > 1 ? "host" : `axis:${p.axis_names[0]}`;
}

function cellColour(mode, p, i, coord) {
  if (mode === "host") return colour(p.process_index[i], p.n_hosts);
  if (mode === "device") return colour(i, p.size);
  if (mode === "chip") return colour(p.chips[i], nChips(p));
  const axis = p.axis_names.indexOf(mode.slice(5));
  return colour(coord[axis], p.axis_sizes[axis]);
}

function legendFor(mode, p) {
  if (mode === "host") {
    return legend("host", [...Array(p.n_hosts).keys()].map((h) => [colour(h, p.n_hosts), `${h}`]));
  }
  if (mode === "device") return legend("device", []);
  if (mode === "chip") return legend(`chip (${p.size / nChips(p)} cores each)`, []);
  const axis = p.axis_names.indexOf(mode.slice(5));
  const n = p.axis_sizes[axis];
  return legend(p.axis_names[axis], [...Array(n).keys()].map((c) => [colour(c, n), `${c}`]));
}

function header(p) {
  const facts = [
    `${p.size} ${p.abstract ? "abstract " : ""}device${p.size === 1 ? "" : "s"}`,
    p.hardware ? `${p.hardware} (${p.device_kind})` : p.device_kind,
    `${p.n_hosts} host${p.n_hosts === 1 ? "" : "s"}`,
  ];
  if (p.cores) facts.splice(2, 0, `${nChips(p)} chips × ${p.size / nChips(p)} cores (each core a device)`);
  if (p.memory_per_device) facts.push(`${fmtBytes(p.memory_per_device)} per device`);
  if (p.peak_flops) facts.push(`peak ${(p.peak_flops / 1e12).toPrecision(3)} TFLOP/s (${p.peak_source})`);
  return el("div", { class: "wb-header" }, [
    el("span", { class: "wb-title", text: p.axis_names.map((a, i) => `${a}=${p.axis_sizes[i]}`).join(" × ") }),
    el("span", { class: "wb-facts", text: facts.join(" · ") }),
  ]);
}

function cellText(p, i, coord) {
  const lines = [`device ${p.device_ids[i]}`,
    p.axis_names.map((a, k) => `${a}=${coord[k]}`).join(" ")];
  if (p.process_index) lines.push(`host ${p.process_index[i]}`);
  if (p.coords) lines.push(`chip (${p.coords[i].join(", ")})${p.cores ? ` core ${p.cores[i]}` : ""}`);
  return lines;
}

/** Draw the mesh payload `p` into nodes for `root`. */
export function drawMesh(root, p, mode, rows) {
  const tip = tooltip(root);
  const grid = gridSplit(p.axis_names, p.axis_sizes, rows);
  const cellWidth = Math.min(MAX_CELL, GRID_WIDTH / grid.cols);
  const level = cellWidth >= 110 ? "full" : cellWidth >= 22 ? "id" : "none";
  const board = el("div", { class: `wb-mesh-grid wb-cells-${level}` });
  board.style.setProperty("grid-template-columns", `repeat(${grid.cols}, ${cellWidth.toFixed(2)}px)`);
  const cells = new Array(grid.rows * grid.cols).fill(null);
  for (let i = 0; i < p.size; i += 1) {
    const coord = unravel(i, p.axis_sizes);
    const [r, c] = gridCell(coord, p.axis_sizes, grid, i);
    const text = cellText(p, i, coord);
    const label = level === "none" ? [] : [el("div", { class: "wb-device-id", text: String(p.device_ids[i]) })];
    if (level === "full") label.push(...text.slice(1).map((t) => el("div", { class: "wb-device-sub", text: t })));
    const bg = cellColour(mode, p, i, coord);
    cells[r * grid.cols + c] = el("div", {
      class: "wb-device",
      "data-device": p.device_ids[i],
      "data-coord": coord.join(","),
      style: { background: bg, color: ink(bg), "grid-row": `${r + 1}`, "grid-column": `${c + 1}` },
      onmousemove: (e) => tip.show(e, text),
      onmouseleave: () => tip.hide(),
    }, label);
  }
  board.append(...cells.filter((x) => x !== null));
  const names = (axes) => axes.map((i) => p.axis_names[i]).join(" × ");
  const axisNote = grid.wrap
    ? `${p.axis_names[0]} runs left to right, wrapping every ${grid.cols}`
    : `rows: ${names(grid.rowAxes)} · columns: ${names(grid.colAxes)}`;
  const key = mode === "device" ? null : legendFor(mode, p);
  return [el("div", { class: "wb-note", text: axisNote }), board, key, tip.node].filter((x) => x !== null);
}

function render({ model, el: host }) {
  const root = el("div", { class: "wb-widget wb-mesh" });
  host.appendChild(root);
  const names = ["payload", "color_by", "rows"];
  function draw() {
    const p = model.get("payload");
    if (!p || !p.axis_names) { root.replaceChildren(el("div", { class: "wb-note", text: "no mesh" })); return; }
    const opts = colourOptions(p);
    let mode = model.get("color_by");
    if (!opts.some(([v]) => v === mode)) mode = defaultColour(p);
    const rows = model.get("rows") || "";
    const grid = gridSplit(p.axis_names, p.axis_sizes, rows);
    const gridOpts = p.axis_names.length > 1
      ? gridChoices(p.axis_names, p.axis_sizes).map((c) => [c.key, `${c.rowAxes.map((i) => p.axis_names[i]).join(" × ")} (${c.rows})`])
      : [];
    const controls = el("div", { class: "wb-controls" }, [
      select("colour by", opts, mode, (v) => { model.set("color_by", v); model.save_changes(); }),
      gridOpts.length > 1 ? select("rows", gridOpts, grid.key, (v) => { model.set("rows", v); model.save_changes(); }) : null,
    ]);
    root.replaceChildren(header(p), controls, ...drawMesh(root, p, mode, rows));
  }
  draw();
  for (const name of names) model.on(`change:${name}`, draw);
  return () => { for (const name of names) model.off(`change:${name}`, draw); };
}

export default { render };
