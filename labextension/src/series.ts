/**
 * One run's metrics as growable numeric columns, plus the smoothing and decimation the
 * charts apply before drawing. Framework-free (tested with jest).
 */

/** Column values as the server sends them (columnar JSON). */
export type RawColumns = Record<string, ReadonlyArray<unknown>>;

/** Indices and values a chart draws (x plus one array per series). */
export interface Decimated {
  x: number[];
  ys: (number | null)[][];
}

/**
 * Numeric metric columns keyed by name, all of one length, `step` strictly increasing.
 * Missing and non-numeric values are stored as NaN.
 */
export class MetricSeries {
  private _length = 0;
  private _capacity = 256;
  private _cols = new Map<string, Float64Array>();

  /** Number of steps held. */
  get length(): number {
    return this._length;
  }

  /** The last step held, or null when empty. */
  get lastStep(): number | null {
    return this._length ? this.column('step')[this._length - 1] : null;
  }

  /** Names of the numeric columns seen so far. */
  keys(): string[] {
    return [...this._cols.keys()];
  }

  /** Whether a column exists and holds at least one finite value. */
  has(key: string): boolean {
    const col = this._cols.get(key);
    return !!col && col.subarray(0, this._length).some(Number.isFinite);
  }

  /** A view of one column (NaN-filled if the column was never sent). */
  column(key: string): Float64Array {
    const col = this._cols.get(key);
    return col ? col.subarray(0, this._length) : new Float64Array(this._length).fill(NaN);
  }

  /** The last finite value of a column, or null. */
  last(key: string): number | null {
    const col = this._cols.get(key);
    for (let i = this._length - 1; col && i >= 0; i--) {
      if (Number.isFinite(col[i])) {
        return col[i];
      }
    }
    return null;
  }

  /**
   * Appends columnar records; rows whose step is not above the last step are dropped
   * (a resumed run re-logs steps). Returns the number of rows appended.
   */
  append(columns: RawColumns): number {
    const steps = columns['step'];
    if (!steps) {
      return 0;
    }
    const keep: number[] = [];
    let last = this.lastStep ?? -Infinity;
    steps.forEach((s, i) => {
      if (typeof s === 'number' && s > last) {
        keep.push(i);
        last = s;
      }
    });
    if (!keep.length) {
      return 0;
    }
    this._reserve(this._length + keep.length);
    for (const [key, values] of Object.entries(columns)) {
      if (!values.some(v => typeof v === 'number')) {
        continue; // text columns (peak_source) are not charted
      }
      const col = this._ensure(key);
      keep.forEach((src, k) => {
        const v = values[src];
        col[this._length + k] = typeof v === 'number' ? v : NaN;
      });
    }
    for (const [key, col] of this._cols) {
      if (!(key in columns)) {
        col.fill(NaN, this._length, this._length + keep.length);
      }
    }
    this._length += keep.length;
    return keep.length;
  }

  /** Drops everything (the server said the metrics file was replaced). */
  clear(): void {
    this._length = 0;
    this._cols.clear();
  }

  private _ensure(key: string): Float64Array {
    let col = this._cols.get(key);
    if (!col) {
      col = new Float64Array(this._capacity).fill(NaN);
      this._cols.set(key, col);
    }
    return col;
  }

  private _reserve(n: number): void {
    if (n <= this._capacity) {
      return;
    }
    while (this._capacity < n) {
      this._capacity *= 2;
    }
    for (const [key, col] of this._cols) {
      const grown = new Float64Array(this._capacity).fill(NaN);
      grown.set(col.subarray(0, this._length));
      this._cols.set(key, grown);
    }
  }
}

/**
 * Exponential moving average with TensorBoard's debiasing: with weight w,
 * `m_i = w m_{i-1} + (1 - w) v_i` and the output is `m_i / (1 - w^n)` after n finite
 * values, so early points are not pulled toward zero. NaN stays NaN; w = 0 is identity.
 */
export function ema(values: ArrayLike<number>, weight: number): Float64Array {
  const out = new Float64Array(values.length);
  const w = Math.min(Math.max(weight, 0), 0.999);
  let m = 0;
  let wn = 1; // w^n after n finite values
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (!Number.isFinite(v)) {
      out[i] = NaN;
      continue;
    }
    m = w * m + (1 - w) * v;
    wn *= w;
    out[i] = w === 0 ? v : m / (1 - wn);
  }
  return out;
}

/**
 * Indices to draw at most about `maxPoints` points per series without losing spikes:
 * the index range is cut into buckets and each bucket keeps its first index and the
 * indices of every series' minimum and maximum (min-max decimation).
 */
export function decimateIndices(
  length: number,
  ys: ReadonlyArray<ArrayLike<number>>,
  maxPoints: number
): number[] {
  if (length <= maxPoints || maxPoints < 4) {
    return Array.from({ length }, (_, i) => i);
  }
  const perBucket = 1 + 2 * Math.max(ys.length, 1);
  const buckets = Math.max(1, Math.floor(maxPoints / perBucket));
  const out: number[] = [];
  const picks: number[] = [];
  for (let b = 0; b < buckets; b++) {
    const lo = Math.floor((b * length) / buckets);
    const hi = Math.floor(((b + 1) * length) / buckets);
    picks.length = 0;
    picks.push(lo);
    for (const y of ys) {
      let iMin = -1;
      let iMax = -1;
      let vMin = Infinity;
      let vMax = -Infinity;
      for (let i = lo; i < hi; i++) {
        const v = y[i];
        if (v < vMin) {
          vMin = v;
          iMin = i;
        }
        if (v > vMax) {
          vMax = v;
          iMax = i;
        }
      }
      if (iMin >= 0) {
        picks.push(iMin, iMax);
      }
    }
    picks.sort((a, b) => a - b);
    for (const i of picks) {
      if (i !== out[out.length - 1]) {
        out.push(i); // buckets are disjoint and in order, so `out` stays sorted
      }
    }
  }
  if (out[out.length - 1] !== length - 1) {
    out.push(length - 1); // the newest point is always drawn
  }
  return out;
}

/** Gathers `x` and each series at the decimated indices (NaN -> null, a gap). */
export function decimate(
  x: ArrayLike<number>,
  ys: ReadonlyArray<ArrayLike<number>>,
  maxPoints: number
): Decimated {
  const idx = decimateIndices(x.length, ys, maxPoints);
  return {
    x: idx.map(i => x[i]),
    ys: ys.map(y => idx.map(i => (Number.isFinite(y[i]) ? y[i] : null)))
  };
}
