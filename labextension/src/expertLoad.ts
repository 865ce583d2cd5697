/**
 * Expert-load heatmap of a mixture-of-experts run for the dashboard: rows are experts,
 * columns steps, the colour each expert's share of its layer's (token, expert)
 * assignments relative to a balanced router (1 = k·tokens/E), from the run's
 * `moe_tokens_per_expert` column (one `[layer][expert]` list per step).
 */
import { el } from './dom';
import { RunMessage } from './types';

/** The metric columns the heatmap needs from the run stream. */
export const EXPERT_KEYS = ['moe_tokens_per_expert', 'moe_dropped', 'moe_entropy'];

/** One step's loads: `load[layer][expert]` assignments. */
export interface ExpertRow {
  step: number;
  load: number[][];
  dropped: number | null;
  entropy: number | null;
}

const isLoad = (v: unknown): v is number[][] =>
  Array.isArray(v) && v.length > 0 && v.every(l => Array.isArray(l) && l.every(x => typeof x === 'number'));

/** The steps' expert loads, appended from run-stream messages (re-logged steps dropped). */
export class ExpertLoadModel {
  rows: ExpertRow[] = [];

  /** Applies one run-stream message; returns whether rows were added. */
  apply(msg: RunMessage): boolean {
    if (msg.type === 'reset') {
      this.rows = [];
      return true;
    }
    if (msg.type !== 'metrics') {
      return false;
    }
    const cols = msg.columns;
    const steps = cols['step'] ?? [];
    const loads = cols['moe_tokens_per_expert'] ?? [];
    let last = this.rows.length ? this.rows[this.rows.length - 1].step : -Infinity;
    let added = false;
    steps.forEach((s, i) => {
      const load = loads[i];
      if (typeof s === 'number' && s > last && isLoad(load)) {
        const num = (v: unknown) => (typeof v === 'number' ? v : null);
        this.rows.push({ step: s, load, dropped: num(cols['moe_dropped']?.[i]),
          entropy: num(cols['moe_entropy']?.[i]) });
        last = s;
        added = true;
      }
    });
    return added;
  }

  get layers(): number {
    return this.rows.length ? this.rows[0].load.length : 0;
  }

  get experts(): number {
    return this.rows.length ? this.rows[0].load[0].length : 0;
  }
}

/**
 * Load relative to balanced, `[step][expert]`, for one layer (or the sum over layers when
 * `layer` < 0): `load · E / total`; 0 for a step without assignments.
 */
export function relativeLoad(rows: ExpertRow[], layer: number): number[][] {
  return rows.map(r => {
    const per = layer >= 0 ? r.load[layer]
      : r.load[0].map((_, e) => r.load.reduce((a, l) => a + l[e], 0));
    const total = per.reduce((a, b) => a + b, 0);
    return per.map(x => (total ? (x * per.length) / total : 0));
  });
}

/** Relative load -> colour: grey at 0, blue at 1 (balanced), red at 2 or more. */
export function heatColour(r: number): string {
  const x = Math.max(0, Math.min(2, r));
  if (x <= 1) {
    return `rgb(${Math.round(235 - 190 * x)}, ${Math.round(235 - 115 * x)}, ${Math.round(235 - 5 * x)})`;
  }
  const t = x - 1;
  return `rgb(${Math.round(45 + 185 * t)}, ${Math.round(120 - 80 * t)}, ${Math.round(230 - 190 * t)})`;
}

/** The heatmap (at most `maxSteps` newest steps) with a layer picker, or an empty node. */
export function expertHeatmap(model: ExpertLoadModel, layer: number,
  onLayer: (layer: number) => void, maxSteps = 300): HTMLElement {
  const box = el('div', 'jp-Workbench-experts');
  if (!model.rows.length) {
    return box;
  }
  const pick = el('select', 'jp-Workbench-expertLayer');
  pick.setAttribute('aria-label', 'MoE layer');
  const options: [number, string][] = [[-1, 'all layers (sum)']];
  for (let i = 0; i < model.layers; i++) {
    options.push([i, `layer ${i}`]);
  }
  for (const [v, label] of options) {
    const o = el('option', '', label);
    o.value = String(v);
    pick.append(o);
  }
  pick.value = String(layer);
  pick.addEventListener('change', () => onLayer(Number(pick.value)));
  const rows = model.rows.slice(-maxSteps);
  const rel = relativeLoad(rows, layer);
  const last = rows[rows.length - 1];
  const facts = el('span', 'jp-Workbench-facts',
    `step ${last.step} · ${model.experts} experts · dropped ${last.dropped ?? '–'} · ` +
    `router entropy ${last.entropy === null ? '–' : last.entropy.toFixed(3)} nats`);
  const grid = el('div', 'jp-Workbench-heat');
  grid.style.gridTemplateColumns = `auto repeat(${rows.length}, minmax(2px, 8px))`;
  grid.setAttribute('role', 'img');
  grid.setAttribute('aria-label',
    `tokens per expert (rows, ${model.experts}) over steps (columns, ${rows.length}), relative to balanced`);
  for (let e = 0; e < model.experts; e++) {
    grid.append(el('span', 'jp-Workbench-heatAxis', `e${e}`));
    rows.forEach((r, s) => {
      const cell = el('span', 'jp-Workbench-heatCell');
      cell.style.background = heatColour(rel[s][e]);
      cell.dataset.cell = `${e},${r.step}`;
      cell.title = `step ${r.step}, expert ${e}: ${rel[s][e].toFixed(2)}× balanced`;
      grid.append(cell);
    });
  }
  const head = el('div', 'jp-Workbench-tools');
  head.append(pick, facts);
  box.append(head, grid);
  return box;
}
