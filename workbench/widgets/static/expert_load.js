// Expert-load heatmap: rows are experts, columns steps; the colour is each expert's share
// of its layer's (token, expert) assignments relative to a balanced router (1 = k·tokens/E):
// white-ish at 0, blue at balanced, red at 2x or more. A layer picker (or their sum).
// Its helpers come from common.js, inlined by workbench/widgets/_assets.py for anywidget.

import { el, fmtNum, legend, select, tooltip } from "./common.js";

/** Relative load -> colour: 0 grey, 1 blue (balanced), >= 2 red. */
export function heat(r) {
  const x = Math.max(0, Math.min(2, r));
  if (x <= 1) {
    const t = x;
    return `rgb(${Math.round(235 - 190 * t)}, ${Math.round(235 - 115 * t)}, ${Math.round(235 - 5 * t)})`;
  }
  const t = x - 1;
  return `rgb(${Math.round(45 + 185 * t)}, ${Math.round(120 - 80 * t)}, ${Math.round(230 - 190 * t)})`;
}

/** Loads of one layer (or the sum over layers when layer < 0) per step: [step][expert]. */
export function layerLoads(d, layer) {
  return d.load.map((perLayer) => layer >= 0 ? perLayer[layer]
    : perLayer[0].map((_, e) => perLayer.reduce((a, l) => a + l[e], 0)));
}

function draw(root, d, layer, tip) {
  const body = el("div", { class: "wb-body" });
  if (!d.steps || !d.steps.length) {
    body.appendChild(el("div", { class: "wb-empty", text: "no expert loads yet (metrics.jsonl has no moe_tokens_per_expert)" }));
    return body;
  }
  const loads = layerLoads(d, layer);
  const maxCols = 400;   // the newest steps when there are more
  const first = Math.max(0, loads.length - maxCols);
  const steps = d.steps.slice(first);
  const grid = el("div", { class: "wb-heat", role: "img",
    "aria-label": `tokens per expert (rows, ${d.experts}) over steps (columns, ${steps.length})`,
    style: { "grid-template-columns": `auto repeat(${steps.length}, 8px)` } });
  for (let e = 0; e < d.experts; e += 1) {
    grid.appendChild(el("div", { class: "wb-axis", text: `e${e}` }));
    for (let s = first; s < loads.length; s += 1) {
      const row = loads[s];
      const total = row.reduce((a, b) => a + b, 0);
      const rel = total ? (row[e] * d.experts) / total : 0;
      const cell = el("div", { class: "wb-block", "data-block": `${e},${d.steps[s]}`,
        style: { background: heat(rel) } });
      cell.addEventListener("mousemove", (ev) => tip.show(ev, [
        `step ${d.steps[s]}, expert ${e}${layer >= 0 ? `, layer ${layer}` : " (all layers)"}`,
        `${row[e]} assignments = ${fmtNum(rel, 3)}x balanced`,
        `dropped this step: ${d.dropped[s] ?? "—"}, router entropy ${fmtNum(d.entropy[s], 3)} nats`]));
      cell.addEventListener("mouseleave", () => tip.hide());
      grid.appendChild(cell);
    }
  }
  body.appendChild(grid);
  body.appendChild(legend("load / balanced share", [[heat(0), "0"], [heat(0.5), "0.5"],
    [heat(1), "1 (balanced)"], [heat(1.5), "1.5"], [heat(2), ">= 2"]]));
  return body;
}

function render({ model, el: host }) {
  const root = el("div", { class: "wb-expert-load" });
  host.appendChild(root);
  const tip = tooltip(root);
  let layer = -1;
  const paint = () => {
    const d = model.get("data") || {};
    const last = d.steps && d.steps.length ? d.steps.length - 1 : -1;
    const options = [[-1, "all layers (sum)"]];
    for (let i = 0; i < (d.layers || 0); i += 1) options.push([i, `layer ${i}`]);
    const header = el("div", { class: "wb-header" }, [
      el("span", { class: "wb-title", text: `expert load · ${model.get("name")}` }),
      select("layer", options, layer, (v) => { layer = Number(v); paint(); }),
      el("span", { class: "wb-facts", text: last < 0 ? "" :
        `step ${d.steps[last]} · ${d.experts} experts · dropped ${d.dropped[last] ?? "—"} · entropy ${fmtNum(d.entropy[last], 3)}` }),
    ]);
    root.replaceChildren(header, draw(root, d, layer, tip), tip.node);
  };
  paint();
  model.on("change:data", paint);
  return () => model.off("change:data", paint);
}

export default { render };
