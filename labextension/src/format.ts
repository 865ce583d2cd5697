/** Number formatting shared by the panel, dashboards and status bar (plain text only). */

/** A loss-like value with 4 significant digits; '–' when missing. */
export function fmtNumber(v: number | null | undefined, digits = 4): string {
  if (v === null || v === undefined || !Number.isFinite(v)) {
    return '–';
  }
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) {
    return v.toExponential(digits - 1);
  }
  return Number(v.toPrecision(digits)).toString();
}

/** A fraction as a percentage: 0.3127 -> '31.3%'. */
export function fmtPercent(v: number | null | undefined): string {
  return v === null || v === undefined || !Number.isFinite(v) ? '–' : `${(v * 100).toFixed(1)}%`;
}

const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];

/** Bytes in binary units: 1536 -> '1.5 KiB'. */
export function fmtBytes(v: number | null | undefined): string {
  if (v === null || v === undefined || !Number.isFinite(v)) {
    return '–';
  }
  let x = v;
  let u = 0;
  while (Math.abs(x) >= 1024 && u < UNITS.length - 1) {
    x /= 1024;
    u++;
  }
  return `${u ? x.toFixed(1) : x.toFixed(0)} ${UNITS[u]}`;
}

/** Seconds as '12.3 ms', '1.25 s' or '2m 03s'. */
export function fmtSeconds(v: number | null | undefined): string {
  if (v === null || v === undefined || !Number.isFinite(v)) {
    return '–';
  }
  if (v === 0) {
    return '0 s';
  }
  if (v < 1) {
    return `${Number((v * 1000).toPrecision(3))} ms`;
  }
  if (v < 60) {
    return `${v.toPrecision(3)} s`;
  }
  const m = Math.floor(v / 60);
  return `${m}m ${String(Math.round(v - 60 * m)).padStart(2, '0')}s`;
}

/** A rate with an SI prefix: 12345 -> '12.3k'. */
export function fmtRate(v: number | null | undefined): string {
  if (v === null || v === undefined || !Number.isFinite(v)) {
    return '–';
  }
  const prefixes: [number, string][] = [[1e12, 'T'], [1e9, 'G'], [1e6, 'M'], [1e3, 'k']];
  for (const [scale, p] of prefixes) {
    if (Math.abs(v) >= scale) {
      return `${(v / scale).toPrecision(3)}${p}`;
    }
  }
  return v.toPrecision(3);
}

/** 'step 120 / 200' or 'step 120'. */
export function fmtStep(step: number, target: number | null | undefined): string {
  return target ? `step ${step} / ${target}` : `step ${step}`;
}
