// Search widget: summary, advice when nothing fits, rank changes, a sortable table of every candidate.
import { el, fmtBytes, select, table } from "./common.js";

const fmtMs = (s) => (s === null || s === undefined ? "—" : `${(s * 1e3).toPrecision(4)} ms`);
const fmtPct = (x) => (x === null || x === undefined ? "—" : `${(100 * x).toFixed(1)}%`);
const fmtRate = (x) => (x === null || x === undefined ? "—" : Math.round(x).toLocaleString("en-US"));
const fmtFits = (f) => (f === true ? "yes" : f === false ? "NO" : "?");
const fmtRank = (r) => (r === null || r === undefined ? "—" : String(r));

const COLUMNS = [
  { key: "order", label: "#", numeric: true },
  { key: "front", label: "" },
  { key: "layout", label: "layout" },
  { key: "memory_per_device", label: "memory/device", numeric: true, format: fmtBytes },
  { key: "fits_text", label: "fits" },
  { key: "over_by", label: "over by", numeric: true, format: (v) => (v ? fmtBytes(v) : "—") },
  { key: "step_seconds", label: "step (pred.)", numeric: true, format: fmtMs },
  { key: "mfu", label: "MFU", numeric: true, format: fmtPct },
  { key: "mfu_fp8", label: "MFU (fp8 peak)", numeric: true, format: fmtPct },
  { key: "tokens_per_s", label: "tokens/s", numeric: true, format: fmtRate },
  { key: "bound", label: "bound" },
  { key: "source", label: "source" },
  { key: "analytic_rank", label: "analytic rank", numeric: true, format: fmtRank },
  { key: "exact_rank", label: "exact rank", numeric: true, format: fmtRank },
  { key: "note", label: "note", wrap: true },
];

const FILTERS = {
  all: () => true,
  fitting: (r) => r.rank !== null,
  pareto: (r) => r.pareto,
  compiled: (r) => r.exact_rank !== null || r.source !== "estimate",
};

function rowsOf(p) {
  const best = p.live && !p.live.exact_best ? "★ best so far" : p.live ? "★ exact best" : "★ best";
  return p.rows.map((r) => ({ ...r, fits_text: fmtFits(r.fits),
    front: r.best ? best : r.pareto ? "◆ pareto" : "" }));
}

function header(p) {
  const [head, ...rest] = p.summary.split("\n");
  return el("div", {}, [
    el("div", { class: "wb-header" }, [el("span", { class: "wb-title", text: "wb.search" }),
      el("span", { class: "wb-facts", text: head.replace(/^wb\.search /, "") })]),
    ...rest.map((line) => el("div", { class: p.advice ? "wb-search-advice" : "wb-search-best", text: line.trim() })),
    p.live ? el("div", { class: `wb-note wb-search-live wb-bg-${p.live.state}`, text: p.live.text }) : el("span"),
  ]);
}

function changes(p) {
  if (!p.rank_changes.length) return null;
  return el("div", { class: "wb-search-changes" }, [
    el("div", { class: "wb-subtitle", text: "where compiling changed the ranking" }),
    ...p.rank_changes.map((c) => el("div", { class: "wb-search-change", text:
      `${c.layout}: analytic #${c.analytic_rank} → exact ${c.exact_rank === null ? "does not fit" : `#${c.exact_rank}`}`
      + ` (${fmtMs(c.analytic_step_seconds)} → ${fmtMs(c.step_seconds)}; ${c.why})` })),
  ]);
}

function skipped(p) {
  if (!p.skipped.length) return null;
  return el("details", { class: "wb-search-skipped" }, [
    el("summary", { text: `${p.skipped.length} candidate(s) not planned` }),
    ...p.skipped.map((s) => el("div", { class: "wb-note", text: `${s.layout}: ${s.reason}` })),
  ]);
}

function render({ model, el: host }) {
  const root = el("div", { class: "wb-widget wb-search" });
  host.appendChild(root);
  function draw() {
    const p = model.get("payload");
    if (!p || !p.rows) { root.replaceChildren(el("div", { class: "wb-note", text: "empty search" })); return; }
    const all = rowsOf(p);
    const tbl = table(COLUMNS, all, { sortKey: "order", descending: false });
    const filter = select("show", [["all", `all (${all.length})`], ["fitting", "fitting"],
      ["pareto", "Pareto front"], ["compiled", "compiled"]], "all", (v) => tbl.setRows(all.filter(FILTERS[v])));
    root.replaceChildren(
      header(p),
      changes(p) || el("span"),
      el("div", { class: "wb-controls" }, [filter]),
      el("div", { class: "wb-scroll" }, [tbl.node]),
      ...p.notes.map((n) => el("div", { class: "wb-note", text: n })),
      skipped(p) || el("span"),
    );
  }
  draw();
  model.on("change:payload", draw);
  return () => model.off("change:payload", draw);
}

export default { render };
