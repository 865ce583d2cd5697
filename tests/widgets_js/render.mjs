// Render one widget module against a fake DOM and model, apply UI actions, report the DOM.
// usage: node render.mjs <module.mjs> <state.json> [actions.json]  -> JSON on stdout
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";
import { byClass, fakeModel, installDom, walk } from "./fake_dom.mjs";

const [modulePath, statePath, actionsPath] = process.argv.slice(2);
installDom();
const mod = await import(pathToFileURL(modulePath).href);
const model = fakeModel(JSON.parse(readFileSync(statePath, "utf8")));
const host = document.createElement("div");
const cleanup = mod.default.render({ model, el: host });
const actions = actionsPath ? JSON.parse(readFileSync(actionsPath, "utf8")) : [];

function find(action) {
  if (action.label) {
    const sel = walk(host).filter((n) => n.tagName === "SELECT" || n.tagName === "INPUT")
      .find((n) => n.getAttribute("aria-label") === action.label);
    if (!sel) throw new Error(`no control labelled ${action.label}`);
    return sel;
  }
  const nodes = byClass(host, action.cls);
  if (!nodes[action.index ?? 0]) throw new Error(`no element .${action.cls}[${action.index ?? 0}]`);
  return nodes[action.index ?? 0];
}
for (const a of actions) {
  if (a.op === "msg") { model.emit("msg:custom", a.msg); continue; }  // a custom message from Python
  const node = find(a);
  if (a.value !== undefined) node.value = String(a.value);
  node.dispatch(a.op);
}

const classes = {};
const nodes = walk(host);
for (const n of nodes) for (const c of n.classList.items) classes[c] = (classes[c] || 0) + 1;
const pick = (cls, attrs) => byClass(host, cls).map((n) => Object.fromEntries(
  attrs.map((a) => [a, a.startsWith("style:") ? n.style.getPropertyValue(a.slice(6)) : a === "text" ? n.textContent : n.getAttribute(a)])));
const report = {
  classes,
  devices: pick("wb-device", ["data-device", "data-coord", "style:grid-row", "style:grid-column", "style:background"]),
  blocks: pick("wb-block", ["data-block", "data-devices", "style:left", "style:top", "style:width", "style:height", "style:background"]),
  rows: byClass(host, "wb-row").map((n) => n.children.map((c) => c.textContent)),
  bars: pick("wb-bar-row", ["data-device", "text"]),
  cols: pick("wb-col", ["data-group", "style:height"]),
  profile_bars: pick("wb-profile-bar", ["title", "style:width"]),
  iframes: walk(host).filter((n) => n.tagName === "IFRAME").map((n) => n.getAttribute("srcdoc")?.length ?? 0),
  charts: walk(host).filter((n) => n.tagName === "SVG").map((n) => ({
    label: n.getAttribute("aria-label"),
    d: walk(n).filter((c) => c.tagName === "PATH").map((c) => c.getAttribute("d")),
    texts: walk(n).filter((c) => c.tagName === "TEXT").map((c) => c.textContent),
    viewBox: n.getAttribute("viewBox"),
  })),
  titles: pick("wb-progress", ["title"]).map((t) => t.title),
  state: model.state,
  saves: model.saved.length,
  sent: model.sent,
  text: host.textContent.slice(0, 4000),
};
if (typeof cleanup === "function") cleanup();
report.handlers_left = Object.values(model.handlers).reduce((a, h) => a + h.length, 0);
process.stdout.write(JSON.stringify(report));
