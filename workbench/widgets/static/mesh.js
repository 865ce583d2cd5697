// Mesh widget: a grid of devices labelled with id, mesh coordinates, host and chip coords.
import { colour, el, fmtBytes, legend, select, tooltip, unravel } from "./common.js";

const LABEL_LIMIT = 128; // above this many devices, cells carry colour only (hover for text)

/** Mesh axes split into (row axes, column axes) so that the grid is a little wider than tall. */
export function gridSplit(sizes, split) {
  const k = sizes.length;
  if (k === 1) {
    const cols = Math.min(sizes[0], 32);
    return { rowAxes: [], colAxes: [0], rows: Math.ceil(sizes[0] / cols), cols, wrap: true };
  }
  let best = split >= 1 && split < k ? split : -1;
  if (best < 0) {
    let bestScore = Infinity;
    for (let s = 1; s < k; s += 1) {
      const r = sizes.slice(0, s).reduce((a, b) => a * b, 1);
      const c = sizes.slice(s).reduce((a, b) => a * b, 1);
      const score = Math.abs(Math.log(c / r) - Math.log(2));
      if (score < bestScore) { bestScore = score; best = s; }
    }
  }
  const rowAxes = [...Array(best).keys()];
  const colAxes = [...Array(k - best).keys()].map((i) => i + best);
  const prod = (axes) => axes.reduce((a, i) => a * sizes[i], 1);
  return { rowAxes, colAxes, rows: prod(rowAxes), cols: prod(colAxes), wrap: false };
}

/** Grid (row, col) of the device with mesh coordinate `coord`. */
export function gridCell(coord, sizes, grid, flat) {
  if (grid.wrap) return [Math.floor(flat / grid.cols), flat % grid.cols];
  const rav = (axes) => axes.reduce((acc, i) => acc * sizes[i] + coord[i], 0);
  return [rav(grid.rowAxes), rav(grid.colAxes)];
}

/** Colour options: each mesh axis, hosts when there are several, devices when few. */
export function colourOptions(p) {
  const opts = p.axis_names.map((a, i) => [`axis:${a}`, `${a} (${p.axis_sizes[i]})`]);
  if (p.process_index && p.n_hosts > 1) opts.push(["host", `host (${p.n_hosts})`]);
  if (p.size <= 32) opts.push(["device", "device"]);
  return opts;
}

function defaultColour(p) {
  return p.process_index && p.n_hosts > 1 ? "host" : `axis:${p.axis_names[0]}`;
}

function cellColour(mode, p, i, coord) {
  if (mode === "host") return colour(p.process_index[i], p.n_hosts);
  if (mode === "device") return colour(i, p.size);
  const axis = p.axis_names.indexOf(mode.slice(5));
  return colour(coord[axis], p.axis_sizes[axis]);
}

function legendFor(mode, p) {
  if (mode === "host") {
    return legend("host", [...Array(p.n_hosts).keys()].map((h) => [colour(h, p.n_hosts), `${h}`]));
  }
  if (mode === "device") return legend("device", []);
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
  if (p.coords) lines.push(`chip (${p.coords[i].join(", ")})`);
  return lines;
}

/** Draw the mesh payload `p` into `root` (a fresh container). */
export function drawMesh(root, p, mode, split) {
  const tip = tooltip(root);
  const grid = gridSplit(p.axis_sizes, split);
  const labelled = p.size <= LABEL_LIMIT;
  const board = el("div", { class: `wb-mesh-grid${labelled ? "" : " wb-dense"}` });
  board.style.setProperty("grid-template-columns", `repeat(${grid.cols}, minmax(0, 1fr))`);
  const cells = new Array(grid.rows * grid.cols).fill(null);
  for (let i = 0; i < p.size; i += 1) {
    const coord = unravel(i, p.axis_sizes);
    const [r, c] = gridCell(coord, p.axis_sizes, grid, i);
    const text = cellText(p, i, coord);
    const cell = el("div", {
      class: "wb-device",
      "data-device": p.device_ids[i],
      "data-coord": coord.join(","),
      style: { background: cellColour(mode, p, i, coord), "grid-row": `${r + 1}`, "grid-column": `${c + 1}` },
      onmousemove: (e) => tip.show(e, text),
      onmouseleave: () => tip.hide(),
    }, labelled ? [el("div", { class: "wb-device-id", text: String(p.device_ids[i]) }),
      ...text.slice(1).map((t) => el("div", { class: "wb-device-sub", text: t }))] : []);
    cells[r * grid.cols + c] = cell;
  }
  board.append(...cells.filter((x) => x !== null));
  const axisNote = grid.wrap
    ? `${p.axis_names[0]} wraps every ${grid.cols}`
    : `rows: ${grid.rowAxes.map((i) => p.axis_names[i]).join(" × ")} · `
      + `columns: ${grid.colAxes.map((i) => p.axis_names[i]).join(" × ")}`;
  const key = mode === "device" ? null : legendFor(mode, p);
  return [el("div", { class: "wb-note", text: axisNote }), board, key, tip.node].filter((x) => x !== null);
}

function render({ model, el: host }) {
  const root = el("div", { class: "wb-widget wb-mesh" });
  host.appendChild(root);
  function draw() {
    const p = model.get("payload");
    if (!p || !p.axis_names) { root.replaceChildren(el("div", { class: "wb-note", text: "no mesh" })); return; }
    const opts = colourOptions(p);
    let mode = model.get("color_by");
    if (!opts.some(([v]) => v === mode)) mode = defaultColour(p);
    const split = model.get("split");
    const controls = el("div", { class: "wb-controls" }, [
      select("colour by", opts, mode, (v) => { model.set("color_by", v); model.save_changes(); }),
      p.axis_names.length > 2 ? select("rows", p.axis_names.slice(0, -1).map((a, i) => [i + 1, p.axis_names.slice(0, i + 1).join(" × ")]),
        gridSplit(p.axis_sizes, split).rowAxes.length, (v) => { model.set("split", Number(v)); model.save_changes(); }) : null,
    ]);
    root.replaceChildren(header(p), controls, ...drawMesh(root, p, mode, split));
  }
  draw();
  for (const name of ["payload", "color_by", "split"]) model.on(`change:${name}`, draw);
  return () => { for (const name of ["payload", "color_by", "split"]) model.off(`change:${name}`, draw); };
}

export default { render };
