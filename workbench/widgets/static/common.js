// Shared helpers for the Workbench widgets: DOM building, formatting, colours, tooltip.
// Only top-level `export function` / `export const` declarations live here: the Python
// side (workbench/widgets/_assets.py) inlines this file into each widget's ESM.

/** Create an element: el("div", {class: "x", title: "t"}, [child, "text"]). */
export function el(tag, attrs, children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = String(value);
    else if (key === "style") for (const [p, v] of Object.entries(value)) node.style.setProperty(p, v);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, String(value));
  }
  for (const child of children || []) {
    if (child === null || child === undefined) continue;
    node.appendChild(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

/** Create an SVG element with attributes: svg("path", {d: "M0,0L1,1"}). */
export function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

/** 0.123456 -> "0.1235" (`digits` significant digits); "—" when missing or not finite. */
export function fmtNum(v, digits = 4) {
  return typeof v === "number" && Number.isFinite(v) ? v.toPrecision(digits) : "—";
}

/** 1536 -> "1.5 KiB" (binary units, as the Python side). */
export function fmtBytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let v = Number(n);
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return i === 0 ? `${v} B` : `${v.toPrecision(3).replace(/\.?0+$/, "")} ${units[i]}`;
}

/** [64, 2048] -> "(64, 2048)". */
export function fmtShape(shape) {
  return `(${shape.join(", ")}${shape.length === 1 ? "," : ""})`;
}

/** [[0, 16], [0, 2048]] -> "[0:16, 0:2048]". */
export function fmtRanges(starts, stops) {
  return `[${starts.map((s, i) => `${s}:${stops[i]}`).join(", ")}]`;
}

/** Device-id lists stay short: [0,1,2,3,4,5,6,7,8,9] -> "0, 1, 2, …, 9 (10)". */
export function fmtIds(ids, max = 6) {
  if (ids.length <= max) return ids.join(", ");
  return `${ids.slice(0, max - 1).join(", ")}, …, ${ids[ids.length - 1]} (${ids.length})`;
}

/** Mesh coordinate (one int per axis) of the device at flat position `flat`. */
export function unravel(flat, sizes) {
  const out = new Array(sizes.length);
  let rest = flat;
  for (let i = sizes.length - 1; i >= 0; i -= 1) {
    out[i] = rest % sizes[i];
    rest = Math.floor(rest / sizes[i]);
  }
  return out;
}

const TABLEAU = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
  "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];

/** Colour of value i out of n: categorical up to 10, then an evenly spread hue ramp. */
export function colour(i, n) {
  if (n <= TABLEAU.length) return TABLEAU[i % TABLEAU.length];
  const hue = Math.round((300 * i) / Math.max(1, n - 1));
  return `hsl(${hue}, 70%, ${i % 2 ? 52 : 60}%)`;
}

/** Black or white text, whichever reads better on colour `c` (from colour()). */
export function ink(c) {
  let r; let g; let b;
  const hsl = /^hsl\((\d+), (\d+)%, (\d+)%\)$/.exec(c);
  if (hsl) {
    const [h, s, l] = [Number(hsl[1]), Number(hsl[2]) / 100, Number(hsl[3]) / 100];
    const f = (n) => { const k = (n + h / 30) % 12; return l - s * Math.min(l, 1 - l) * Math.max(-1, Math.min(k - 3, 9 - k, 1)); };
    [r, g, b] = [f(0), f(8), f(4)];
  } else if (/^#[0-9a-f]{6}$/i.test(c)) {
    [r, g, b] = [1, 3, 5].map((i) => parseInt(c.slice(i, i + 2), 16) / 255);
  } else {
    return "#111";
  }
  const lum = 0.2126 * r + 0.7152 * g + 0.0722 * b;
  return lum < 0.42 ? "#fff" : "#111";
}

/** CSS background for a block held by several colours: equal stripes, at most 8. */
export function stripes(colours) {
  const uniq = [...new Set(colours)];
  if (uniq.length === 1) return uniq[0];
  const shown = uniq.slice(0, 8);
  const step = 100 / shown.length;
  const stops = shown.map((c, i) => `${c} ${(i * step).toFixed(2)}% ${((i + 1) * step).toFixed(2)}%`);
  return `linear-gradient(90deg, ${stops.join(", ")})`;
}

/** A labelled <select>; options: [[value, label], ...]. */
export function select(label, options, value, onChange) {
  const sel = el("select", { class: "wb-select", "aria-label": label });
  for (const [v, text] of options) {
    const opt = el("option", { value: String(v), text });
    if (String(v) === String(value)) opt.setAttribute("selected", "selected");
    sel.appendChild(opt);
  }
  sel.value = String(value);
  sel.addEventListener("change", () => onChange(sel.value));
  return el("label", { class: "wb-control" }, [`${label} `, sel]);
}

/** One floating tooltip per widget root: show(event, lines) / hide(). */
export function tooltip(root) {
  const tip = el("div", { class: "wb-tooltip", role: "tooltip" });
  tip.style.setProperty("display", "none");
  root.appendChild(tip);
  return {
    node: tip,
    show(event, lines) {
      tip.replaceChildren(...lines.map((line) => el("div", { text: line })));
      tip.style.setProperty("display", "block");
      const box = root.getBoundingClientRect ? root.getBoundingClientRect() : { left: 0, top: 0 };
      tip.style.setProperty("left", `${(event.clientX || 0) - box.left + 12}px`);
      tip.style.setProperty("top", `${(event.clientY || 0) - box.top + 12}px`);
    },
    hide() { tip.style.setProperty("display", "none"); },
  };
}

/** Legend chips: [[colour, label], ...]; more than 16 become one colour ramp, first to last. */
export function legend(title, items) {
  const head = el("span", { class: "wb-legend-title", text: title });
  if (items.length > 16) {
    const step = (items.length - 1) / 31;
    const stops = [...Array(32).keys()].map((i) => items[Math.round(i * step)][0]);
    return el("div", { class: "wb-legend" }, [head,
      el("span", { class: "wb-chip", text: items[0][1] }),
      el("span", { class: "wb-ramp", style: { background: `linear-gradient(90deg, ${stops.join(", ")})` } }),
      el("span", { class: "wb-chip", text: `${items[items.length - 1][1]} (${items.length} values)` })]);
  }
  return el("div", { class: "wb-legend" }, [head, ...items.map((item) => el("span", { class: "wb-chip" }, [
    el("span", { class: "wb-swatch", style: { background: item[0] } }), item[1]]))]);
}

/**
 * A sortable table. columns: [{key, label, numeric, format}]; rows: array of objects.
 * onRow(row, tr) is called on click. Returns {node, setRows(rows), highlight(pred)}.
 */
export function table(columns, rows, { onRow, sortKey = null, descending = true } = {}) {
  let state = { key: sortKey, desc: descending };
  const body = el("tbody");
  const heads = columns.map((c) => el("th", {
    class: c.numeric ? "wb-num wb-sortable" : "wb-sortable",
    text: c.label,
    title: `sort by ${c.label}`,
    onclick: () => {
      state = { key: c.key, desc: state.key === c.key ? !state.desc : !!c.numeric };
      draw();
    },
  }));
  let current = rows;
  function draw() {
    heads.forEach((h, i) => {
      const c = columns[i];
      h.setAttribute("aria-sort", state.key !== c.key ? "none" : state.desc ? "descending" : "ascending");
    });
    let ordered = current;
    if (state.key !== null) {
      const k = state.key;
      ordered = [...current].sort((a, b) => {
        const x = a[k] ?? -Infinity;
        const y = b[k] ?? -Infinity;
        const cmp = x < y ? -1 : x > y ? 1 : 0;
        return state.desc ? -cmp : cmp;
      });
    }
    body.replaceChildren(...ordered.map((row) => {
      const tr = el("tr", { class: "wb-row" }, columns.map((c) => el("td", {
        class: c.numeric ? "wb-num" : c.wrap ? "wb-wrap" : null,
        text: c.format ? c.format(row[c.key], row) : String(row[c.key] ?? ""),
      })));
      tr.rowData = row;
      if (onRow) tr.addEventListener("click", () => onRow(row, tr));
      return tr;
    }));
  }
  draw();
  const node = el("table", { class: "wb-table" }, [el("thead", {}, [el("tr", {}, heads)]), body]);
  return {
    node,
    setRows(next) { current = next; draw(); },
    highlight(pred) {
      for (const tr of body.children) tr.classList.toggle("wb-selected", pred(tr.rowData));
    },
  };
}

/** Colours of a chart's faint earlier curves (see lineChart's `others`). */
const FAINT = ["#9c9c9c", "#b07aa1", "#76b7b2", "#edc948"];

/**
 * A line chart of [[step, value], ...] (steps ascending) with min/max and first/last step
 * labels; update(points) redraws it in place (no new nodes). Values are multiplied by
 * `scale` and labelled with `unit` (MFU: scale 100, unit "%"). update(points, second,
 * secondName, others, name) also draws `second` dashed and each of `others`
 * ([{name, points}], e.g. a restarted run's earlier attempts) faint, named in the label
 * beside `name` (the main curve's).
 */

export function lineChart(title, { width = 320, height = 140, scale = 1, unit = "" } = {}) {
  const pad = { l: 48, r: 8, t: 20, b: 18 };
  const box = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
    class: "wb-chart", "aria-label": title });
  const label = svg("text", { x: 6, y: 13, "font-size": 11, fill: "currentColor" });
  label.textContent = title;
  const path = svg("path", { d: "", fill: "none", stroke: "#4e79a7", "stroke-width": 1.5,
    class: "wb-chart-path" });
  // an optional second series (e.g. held-out loss), dashed, on the same axes; its path is
  // added to the chart when the first such series arrives
  const path2 = svg("path", { d: "", fill: "none", stroke: "#e15759", "stroke-width": 1.5,
    "stroke-dasharray": "4 2", class: "wb-chart-path2" });
  const texts = [0, 1, 2, 3].map(() => svg("text", { "font-size": 10, fill: "#666" }));
  for (const node of [label, path, ...texts]) box.appendChild(node);
  let shown2 = false;
  // optional earlier curves (e.g. the earlier attempts of a restarted run): one thin, faint
  // path each, on the same axes, added when the first one arrives
  const faint = [];
  function update(points, second = [], secondName = "", others = [], name = "") {
    const more = Array.isArray(second) ? second : [];
    const rest = (Array.isArray(others) ? others : []).filter(
      (o) => o && Array.isArray(o.points) && o.points.length);
    const names = rest.length ? ` · ${rest.map((o) => o.name).join(", ")} (faint)` +
      (name ? ` · ${name}` : "") : "";
    label.textContent = title + names + (more.length && secondName ? ` · ${secondName} (dashed)` : "");
    if (more.length && !shown2) { box.appendChild(path2); shown2 = true; }
    while (faint.length < rest.length) {
      const p = svg("path", { d: "", fill: "none", stroke: FAINT[faint.length % FAINT.length],
        "stroke-width": 1, opacity: 0.55, class: "wb-chart-faint" });
      box.appendChild(p);
      faint.push(p);
    }
    faint.forEach((p) => p.setAttribute("d", ""));
    if (!points || !points.length) {
      path.setAttribute("d", "");
      path2.setAttribute("d", "");
      texts[0].textContent = "waiting for the first step…";
      texts[0].setAttribute("x", pad.l);
      texts[0].setAttribute("y", height / 2);
      texts[0].setAttribute("text-anchor", "start");
      for (const t of texts.slice(1)) t.textContent = "";
      return;
    }
    const xs = points.map((p) => p[0]);
    const ys = points.map((p) => p[1] * scale);
    const ys2 = more.map((p) => p[1] * scale);
    const earlier = rest.flatMap((o) => o.points);
    const x0 = Math.min(xs[0], ...more.map((p) => p[0]), ...earlier.map((p) => p[0]));
    const x1 = Math.max(xs[xs.length - 1], ...more.map((p) => p[0]), ...earlier.map((p) => p[0]));
    let y0 = Math.min(...ys, ...ys2, ...earlier.map((p) => p[1] * scale));
    let y1 = Math.max(...ys, ...ys2, ...earlier.map((p) => p[1] * scale));
    if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
    const sx = (x) => pad.l + ((x - x0) / Math.max(1, x1 - x0)) * (width - pad.l - pad.r);
    const sy = (y) => height - pad.b - ((y - y0) / (y1 - y0)) * (height - pad.t - pad.b);
    path.setAttribute("d", ys.map((y, i) => `${i ? "L" : "M"}${sx(xs[i]).toFixed(1)},${sy(y).toFixed(1)}`).join(""));
    path2.setAttribute("d", ys2.map((y, i) => `${i ? "L" : "M"}${sx(more[i][0]).toFixed(1)},${sy(y).toFixed(1)}`).join(""));
    rest.forEach((o, k) => faint[k].setAttribute("d", o.points.map((p, i) =>
      `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1] * scale).toFixed(1)}`).join("")));
    const place = [[pad.l - 4, pad.t + 4, "end", `${fmtNum(y1, 3)}${unit}`],
      [pad.l - 4, height - pad.b, "end", `${fmtNum(y0, 3)}${unit}`],
      [pad.l, height - 4, "start", `step ${x0}`], [width - pad.r, height - 4, "end", `step ${x1}`]];
    place.forEach(([x, y, anchor, text], i) => {
      texts[i].setAttribute("x", x);
      texts[i].setAttribute("y", y);
      texts[i].setAttribute("text-anchor", anchor);
      texts[i].textContent = text;
    });
  }
  return { node: box, update };
}

/** A thin progress bar; update(fraction) sets its fill and its title (a percentage). */
export function progressBar() {
  const fill = el("div", { class: "wb-progress-fill" });
  const node = el("div", { class: "wb-progress" }, [fill]);
  function update(fraction) {
    const pct = `${(100 * Math.max(0, Math.min(1, fraction || 0))).toFixed(1)}%`;
    fill.style.setProperty("width", pct);
    node.setAttribute("title", pct);
  }
  return { node, update };
}
