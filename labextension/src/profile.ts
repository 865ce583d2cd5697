/**
 * A run's profiles (`trainer.profile()`, served by `GET .../runs/<id>/profiles`): one pair
 * of bars per term of the plan's prediction, predicted beside measured seconds per step,
 * the largest disagreement named in words, and the profiler's overhead. `parseProfiles`
 * checks what the server sent (framework-free, jest); `profileView` draws one profile.
 */
import { el } from './dom';
import { fmtRate, fmtSeconds } from './format';

/** One term: predicted and measured seconds per step (collective rows: kind and axes). */
export interface IProfileRow {
  name: string;
  predicted: number;
  measured: number;
  kind: string;
  axes: string[];
  count: number;
  wait: number;
  note: string;
}

/** One profile of a run: `profiles/<name>/report.json`. */
export interface IProfile {
  name: string;
  step: number | null;
  rows: IProfileRow[];
  verdict: string;
  planName: string;
  steps: number | null;
  tokensPerS: { outside: number | null; during: number | null };
  calibrated: boolean;
  problem: string | null;
  topOps: { name: string; category: string; seconds: number; source: string }[];
}

const finite = (v: unknown): v is number => typeof v === 'number' && Number.isFinite(v);
const text = (v: unknown, max = 2000): string => (typeof v === 'string' ? v.slice(0, max) : '');
const obj = (v: unknown): Record<string, unknown> =>
  v !== null && typeof v === 'object' && !Array.isArray(v) ? (v as Record<string, unknown>) : {};
const list = (v: unknown): unknown[] => (Array.isArray(v) ? v : []);

/** A row checked: a name and finite seconds, else null (dropped). */
export function parseRow(value: unknown): IProfileRow | null {
  const r = obj(value);
  if (typeof r.name !== 'string' || !finite(r.predicted) || !finite(r.measured)) {
    return null;
  }
  return {
    name: r.name.slice(0, 200), predicted: r.predicted, measured: r.measured,
    kind: text(r.kind, 100), axes: list(r.axes).filter((a): a is string => typeof a === 'string'),
    count: finite(r.count) ? r.count : 0, wait: finite(r.wait) ? r.wait : 0, note: text(r.note)
  };
}

/** The `profiles` answer checked: anything malformed is dropped, never thrown. */
export function parseProfiles(value: unknown): IProfile[] {
  return list(obj(value).profiles).map(item => {
    const p = obj(item);
    const t = obj(p.tokens_per_s);
    const pos = (v: unknown) => (finite(v) && v > 0 ? v : null);
    return {
      name: text(p.name, 200), step: finite(p.step) ? p.step : null,
      rows: list(p.rows).map(parseRow).filter((r): r is IProfileRow => r !== null),
      verdict: text(p.verdict), planName: text(p.plan_name, 200),
      steps: finite(p.steps) ? p.steps : null,
      tokensPerS: { outside: pos(t.outside), during: pos(t.during) },
      calibrated: p.calibrated === true,
      problem: typeof p.problem === 'string' ? p.problem.slice(0, 2000) : null,
      topOps: list(p.top_ops).map(obj).filter(o => finite(o.seconds)).slice(0, 20).map(o => ({
        name: text(o.name, 300), category: text(o.category, 50), seconds: o.seconds as number,
        source: text(o.source, 300)
      }))
    };
  });
}

/** The term farthest from its prediction (never the whole step), or null without terms. */
export function largestDisagreement(rows: IProfileRow[]): IProfileRow | null {
  let worst: IProfileRow | null = null;
  for (const r of rows) {
    if (r.name !== 'step' && (!worst || Math.abs(r.measured - r.predicted) >
      Math.abs(worst.measured - worst.predicted))) {
      worst = r;
    }
  }
  return worst;
}

/** 'profiled 5,000 tokens/s vs 5,200 outside (overhead +4%)', '' when either is unknown. */
export function overheadText(t: IProfile['tokensPerS']): string {
  if (t.during === null || t.outside === null) {
    return '';
  }
  const o = t.outside / t.during - 1;
  return `${fmtRate(t.during)} tokens/s profiled vs ${fmtRate(t.outside)} outside ` +
    `(profiler overhead ${o >= 0 ? '+' : ''}${(o * 100).toFixed(0)}%)`;
}

/**
 * One profile: a header (steps, overhead), the verdict, a legend and one row per term with
 * a predicted and a measured bar on a shared scale. Rows carry `data-term`,
 * `data-predicted` and `data-measured` (seconds); the largest disagreement
 * `jp-mod-worst`. Every value is text.
 */
export function profileView(p: IProfile): HTMLElement {
  const box = el('div', 'jp-Workbench-profile');
  box.dataset.profile = p.name;
  const facts = [`profile at step ${p.step ?? p.name}`, p.planName ? `plan ${p.planName}` : '',
    p.steps !== null ? `${p.steps} steps traced` : '',
    p.calibrated ? 'calibrated prediction' : 'prediction from the hardware table',
    overheadText(p.tokensPerS)].filter(Boolean).join(' · ');
  box.append(el('div', 'jp-Workbench-profileFacts', facts));
  if (p.problem) {
    box.append(el('pre', 'jp-Workbench-error jp-Workbench-problem', p.problem));
  }
  if (!p.rows.length) {
    return box;
  }
  box.append(el('div', 'jp-Workbench-profileVerdict', p.verdict));
  const legend = el('div', 'jp-Workbench-profileLegend');
  legend.append(el('span', 'jp-Workbench-profileKey jp-mod-predicted', 'predicted'),
    el('span', 'jp-Workbench-profileKey jp-mod-measured', 'measured'));
  box.append(legend);
  const max = Math.max(1e-12, ...p.rows.flatMap(r => [Math.abs(r.predicted), Math.abs(r.measured)]));
  const worst = largestDisagreement(p.rows);
  for (const r of p.rows) {
    const row = el('div', 'jp-Workbench-profileRow');
    row.dataset.term = r.name;
    row.dataset.predicted = String(r.predicted);
    row.dataset.measured = String(r.measured);
    row.classList.toggle('jp-mod-worst', r === worst);
    const name = el('span', 'jp-Workbench-profileName', r.name);
    name.title = [r.note, r.count ? `${r.count} per step` : '',
      r.wait > 0 ? `${fmtSeconds(r.wait)} waiting for the other devices` : '']
      .filter(Boolean).join('\n');
    const pair = el('div', 'jp-Workbench-profilePair');
    for (const [cls, v, what] of [['jp-mod-predicted', r.predicted, 'predicted'],
      ['jp-mod-measured', r.measured, 'measured']] as const) {
      const bar = el('div', `jp-Workbench-profileBar ${cls}`);
      bar.style.width = `${(100 * Math.abs(v)) / max}%`;
      bar.title = `${what} ${fmtSeconds(v)} per step`;
      pair.append(bar);
    }
    row.append(name, pair,
      el('span', 'jp-Workbench-profileNums', `${fmtSeconds(r.predicted)} → ${fmtSeconds(r.measured)}`));
    box.append(row);
  }
  return box;
}
