/**
 * A run's predicted step (the plan's, recorded in run.json by `Trainer.from_plan`) beside
 * the measured one. The server checks the field already; this checks it again, since any
 * JSON may reach the lab (an older server, a hand-edited file). Framework-free (jest).
 */
import { fmtPercent, fmtSeconds } from './format';

/**
 * How sure a prediction is: the factors of the predicted step the measured one has been
 * seen between (null: no band), and where they come from or why there is none.
 */
export interface IBand {
  low: number | null;
  high: number | null;
  /** 'calibration', 'reference rows' or 'none'. */
  basis: string;
  /** 'from 3 calibration layouts (measured/predicted 0.95-1.08x)'. */
  summary: string;
  source: string;
}

/** The numbers of a prediction that the views use (null: absent or unusable). */
export interface IPrediction {
  step_seconds: number | null;
  mfu: number | null;
  tokens_per_s: number | null;
  compiler_seconds: number | null;
  bound: string | null;
  source: string | null;
  source_reason: string | null;
  hardware: string | null;
  plan_name: string | null;
  /** Seconds per roofline term (compute, memory, communication, ...). */
  breakdown: Record<string, number>;
  /** The error band; null when the prediction carries none (an older run). */
  band: IBand | null;
}

const NUMBERS = ['step_seconds', 'mfu', 'tokens_per_s', 'compiler_seconds'] as const;
const TEXTS = ['bound', 'source', 'source_reason', 'hardware', 'plan_name'] as const;
const TEXT_MAX = 500;

/** A finite positive number, else null (never a string, boolean or NaN). */
export function positive(v: unknown): number | null {
  return typeof v === 'number' && Number.isFinite(v) && v > 0 ? v : null;
}

/**
 * A `prediction` field checked: finite positive numbers, strings as text, anything else
 * dropped. Null when it is no object or holds neither a step time nor an MFU.
 */
export function parsePrediction(value: unknown): IPrediction | null {
  if (value === null || typeof value !== 'object' || Array.isArray(value)) {
    return null;
  }
  const v = value as Record<string, unknown>;
  const out: IPrediction = {
    step_seconds: null, mfu: null, tokens_per_s: null, compiler_seconds: null, bound: null,
    source: null, source_reason: null, hardware: null, plan_name: null, breakdown: {},
    band: null
  };
  for (const k of NUMBERS) {
    out[k] = positive(v[k]);
  }
  if (out.step_seconds === null && out.mfu === null) {
    return null;
  }
  for (const k of TEXTS) {
    const t = v[k];
    out[k] = typeof t === 'string' ? t.slice(0, TEXT_MAX) : null;
  }
  const b = v['breakdown'];
  if (b !== null && typeof b === 'object' && !Array.isArray(b)) {
    for (const [k, x] of Object.entries(b as Record<string, unknown>)) {
      if (typeof x === 'number' && Number.isFinite(x) && x >= 0) {
        out.breakdown[k] = x;
      }
    }
  }
  out.band = parseBand(v['band']);
  return out;
}

/**
 * A prediction's `band` checked: both factors finite, positive and in order, or both
 * null (no band); its texts as text. Null when it is no object.
 */
export function parseBand(value: unknown): IBand | null {
  if (value === null || typeof value !== 'object' || Array.isArray(value)) {
    return null;
  }
  const v = value as Record<string, unknown>;
  const low = positive(v['low']);
  const high = positive(v['high']);
  const known = low !== null && high !== null && low <= high;
  const text = (k: string): string =>
    typeof v[k] === 'string' ? (v[k] as string).slice(0, TEXT_MAX) : '';
  return { low: known ? low : null, high: known ? high : null, basis: text('basis') || 'none',
    summary: text('summary'), source: text('source') };
}

/**
 * A predicted value's band as text: '9.50 ms–11.3 ms' (a time: value × the factors) or
 * '28.1%–33.0%' (a rate: value ÷ them); null without a band.
 */
export function bandRange(metric: 'step_time' | 'mfu', predicted: number,
  band: IBand | null): string | null {
  if (band === null || band.low === null || band.high === null) {
    return null;
  }
  if (metric === 'step_time') {
    return `${fmtSeconds(predicted * band.low)}–${fmtSeconds(predicted * band.high)}`;
  }
  return `${fmtPercent(predicted / band.high)}–${fmtPercent(predicted / band.low)}`;
}

/** The band's line of a tooltip: 'band 9.50 ms–11.3 ms, from ...' or 'no band: why'. */
export function describeBand(metric: 'step_time' | 'mfu', predicted: number,
  band: IBand | null): string {
  if (band === null) {
    return '';
  }
  const range = bandRange(metric, predicted, band);
  return range === null ? `no band: ${band.source}` : `band ${range}, ${band.summary}`;
}

/** Median of the last `n` finite values of a column (a steady measure of recent steps). */
export function recentMedian(values: ArrayLike<number>, n = 20): number | null {
  const tail: number[] = [];
  for (let i = values.length - 1; i >= 0 && tail.length < n; i--) {
    if (Number.isFinite(values[i])) {
      tail.push(values[i]);
    }
  }
  if (!tail.length) {
    return null;
  }
  tail.sort((a, b) => a - b);
  const m = tail.length >> 1;
  return tail.length % 2 ? tail[m] : (tail[m - 1] + tail[m]) / 2;
}

/** measured ÷ predicted, or null when either is missing. */
export function ratio(measured: number | null | undefined,
  predicted: number | null | undefined): number | null {
  const m = positive(measured);
  const p = positive(predicted);
  return m === null || p === null ? null : m / p;
}

/** `1.234` -> '1.23×'; '' when missing. */
export function fmtRatio(r: number | null): string {
  return r === null ? '' : `${Number(r.toPrecision(3))}×`;
}

/** What a KPI card shows under the measured value, and its tooltip. */
export interface IVersus {
  text: string;
  title: string;
}

/**
 * The predicted line of a KPI card: 'pred. 10 ms · measured 1.23×' (time) or
 * 'pred. 31.0% · measured 0.5×' (MFU); null without a prediction of that metric.
 * `recent` is the measured median of the last steps (the ratio's numerator).
 */
export function versus(metric: 'step_time' | 'mfu', recent: number | null,
  p: IPrediction | null): IVersus | null {
  const predicted = metric === 'step_time' ? p?.step_seconds ?? null : p?.mfu ?? null;
  if (p === null || predicted === null) {
    return null;
  }
  const fmt = metric === 'step_time' ? fmtSeconds : fmtPercent;
  const r = ratio(recent, predicted);
  const range = bandRange(metric, predicted, p.band);
  const text = `pred. ${fmt(predicted)}` + (range === null ? '' : ` (${range})`) +
    (r === null ? '' : ` · measured ${fmtRatio(r)}`);
  const lines = [
    `predicted ${metric === 'step_time' ? 'step time' : 'MFU'} ${fmt(predicted)}` +
      (p.bound ? ` (${p.bound}-bound)` : ''),
    `measured ${fmt(recent)} (median of the last 20 steps)` +
      (r === null ? '' : `: ${fmtRatio(r)} the prediction`),
    describeBand(metric, predicted, p.band),
    metric === 'step_time' ? describeTerms(p) : '',
    describePrediction(p)
  ];
  return { text, title: lines.filter(Boolean).join('\n') };
}

/**
 * The predicted step's terms: 'compute 10 ms · HBM 4 ms · communication 1 ms not hidden ·
 * host transfers 2 ms not hidden (of 5 ms on the host link)'; the host term only where
 * activations are offloaded to host memory. '' without a breakdown.
 */
export function describeTerms(p: IPrediction): string {
  const b = p.breakdown;
  const parts: string[] = [];
  for (const [key, label] of [['compute', 'compute'], ['memory', 'HBM']] as const) {
    if (b[key] !== undefined) {
      parts.push(`${label} ${fmtSeconds(b[key])}`);
    }
  }
  if (b.communication !== undefined) {
    parts.push(`communication ${fmtSeconds(b.communication)} not hidden`);
  }
  if (b.host_link) {
    parts.push(`host transfers ${fmtSeconds(b.host_transfers ?? 0)} not hidden ` +
      `(of ${fmtSeconds(b.host_link)} on the host link)`);
  }
  return parts.join(' · ');
}

/** Where a prediction comes from: 'plan tiny · cpu-compiler on cpu — reason'. */
export function describePrediction(p: IPrediction): string {
  const head = [p.plan_name ? `plan ${p.plan_name}` : '',
    p.source ? `${p.source}${p.hardware ? ` on ${p.hardware}` : ''}` : p.hardware ?? ''
  ].filter(Boolean).join(' · ');
  return [head, p.source_reason ?? ''].filter(Boolean).join(' — ');
}

/** The runs list's hint: 'pred. 10 ms/step · MFU 31.0% (cpu-compiler)', '' without one. */
export function predictionHint(value: unknown): string {
  const p = parsePrediction(value);
  if (p === null) {
    return '';
  }
  const range = p.step_seconds !== null ? bandRange('step_time', p.step_seconds, p.band) : null;
  const bits = [p.step_seconds !== null ? `${fmtSeconds(p.step_seconds)}/step` +
    (range === null ? '' : ` (${range})`) : '',
    p.mfu !== null ? `MFU ${fmtPercent(p.mfu)}` : ''].filter(Boolean).join(' · ');
  return `pred. ${bits}${p.source ? ` (${p.source})` : ''}`;
}
