// Profile widget: predicted vs measured seconds per step, one pair of bars per term.
import { el, table } from "./common.js";

const ms = (s) => (s === null || s === undefined ? "—" : `${(s * 1e3).toPrecision(3)} ms`);

export function bars(rows) {
  const max = Math.max(1e-12, ...rows.flatMap((r) => [r.predicted, r.measured]));
  return el("div", { class: "wb-profile-bars" }, rows.map((r) => el("div", { class: "wb-profile-row" }, [
    el("span", { class: "wb-profile-name", text: r.name }),
    el("div", { class: "wb-profile-pair" }, [
      el("div", { class: "wb-profile-bar wb-predicted", style: { width: `${(100 * r.predicted) / max}%` }, title: `predicted ${ms(r.predicted)}` }),
      el("div", { class: "wb-profile-bar wb-measured", style: { width: `${(100 * r.measured) / max}%` }, title: `measured ${ms(r.measured)}` }),
    ]),
    el("span", { class: "wb-profile-nums", text: `${ms(r.predicted)} → ${ms(r.measured)}` }),
  ])));
}

const OPS = [
  { key: "seconds", label: "ms/step", numeric: true, format: (s) => (s * 1e3).toPrecision(3) },
  { key: "category", label: "category" },
  { key: "name", label: "op" },
  { key: "source", label: "source" },
];

function render({ model, el: host }) {
  const root = el("div", { class: "wb-widget wb-profile" });
  host.appendChild(root);
  function draw() {
    const p = model.get("payload");
    if (!p || !p.rows) { root.replaceChildren(el("div", { class: "wb-note", text: "no profile" })); return; }
    const t = p.tokens_per_s || {};
    const facts = [`${p.steps} steps`, `${p.devices} devices`, p.calibrated ? "calibrated prediction" : "table prediction",
      t.during && t.outside ? `${Math.round(t.during)} tokens/s profiled vs ${Math.round(t.outside)} outside` : null];
    root.replaceChildren(
      el("div", { class: "wb-header" }, [
        el("span", { class: "wb-title", text: `profile: ${p.plan_name || "step"}` }),
        el("span", { class: "wb-facts", text: facts.filter((x) => x).join(" · ") }),
      ]),
      el("div", { class: "wb-profile-verdict", text: p.verdict }),
      el("div", { class: "wb-profile-legend" }, [
        el("span", { class: "wb-profile-key wb-predicted", text: "predicted" }),
        el("span", { class: "wb-profile-key wb-measured", text: "measured" }),
      ]),
      bars(p.rows),
      el("div", { class: "wb-scroll" }, [table(OPS, p.top_ops, { sortKey: "seconds" }).node]),
      el("div", { class: "wb-note", text: `trace: ${p.directory} (xprof --logdir ${p.directory})` }),
    );
  }
  draw();
  model.on("change:payload", draw);
  return () => model.off("change:payload", draw);
}

export default { render };
