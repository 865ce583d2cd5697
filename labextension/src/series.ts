/**
 * One run's metrics as growable numeric columns, plus the smoothing and decimation the
 * charts apply before drawing. Framework-free (tested with jest).
 */

/** Column values as the server sends them (columnar JSON). */
export type RawColumns = Record<string, ReadonlyArray<unknown>>;

/**
 * Indices and values a chart draws (x plus one array per series): null is a gap (the
 * line breaks), undefined a missing value (the line joins across it).
 */
export interface Decimated {
  x: number[];
  ys: (number | null | undefined)[][];
}

/** How a column stores a value that was NaN, ±Infinity or null in the metrics file (the
 * server lists those rows in `gaps`): drawn as a gap. */
export const GAP = Infinity;

/**
 * Numeric metric columns keyed by name, all of one length, `step` strictly increasing.
 * Missing and non-numeric values are stored as NaN, gaps (see `GAP`) as Infinity.
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
   * (a resumed run re-logs steps). `gaps` lists, per column, the rows that hold a gap
   * (see `GAP`). Returns the number of rows appended.
   */
  append(columns: RawColumns, gaps: Record<string, ReadonlyArray<number>> = {}): number {
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
      const gap = new Set(gaps[key] ?? []);
      keep.forEach((src, k) => {
        const v = values[src];
        col[this._length + k] = gap.has(src) ? GAP : typeof v === 'number' ? v : NaN;
      });
    }
    for (const [key, rows] of Object.entries(gaps)) {
      if (key in columns && !this._cols.has(key) && rows.length) {
        const col = this._ensure(key); // a column of gaps only (every value NaN)
        const gap = new Set(rows);
        keep.forEach((src, k) => (col[this._length + k] = gap.has(src) ? GAP : NaN));
      }
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
 * Exponential moving average with TensorBoard's debiasing, kept up to date on an
 * append-only column: with weight w, `m_i = w m_{i-1} + (1 - w) v_i` and the output is
 * `m_i / (1 - w^n)` after n finite values, so early points are not pulled toward zero.
 * NaN stays NaN and a gap a gap; w = 0 is the identity. Only points appended since the last call are
 * computed (a new weight or a shorter column starts over).
 */
export class EmaCache {
  private _out = new Float64Array(0);
  private _n = 0;
  private _m = 0;
  private _wn = 1; // w^n after n finite values
  private _w = NaN;

  update(values: ArrayLike<number>, weight: number): Float64Array {
    const w = Math.min(Math.max(weight, 0), 0.999);
    if (w !== this._w || values.length < this._n) {
      this._n = 0;
      this._m = 0;
      this._wn = 1;
      this._w = w;
    }
    if (this._out.length < values.length) {
      const grown = new Float64Array(Math.max(values.length, 2 * this._out.length));
      grown.set(this._out.subarray(0, this._n));
      this._out = grown;
    }
    for (let i = this._n; i < values.length; i++) {
      const v = values[i];
      if (!Number.isFinite(v)) {
        this._out[i] = v === GAP ? GAP : NaN;
        continue;
      }
      this._m = w * this._m + (1 - w) * v;
      this._wn *= w;
      this._out[i] = w === 0 ? v : this._m / (1 - this._wn);
    }
    this._n = values.length;
    return this._out.subarray(0, values.length);
  }
}

/** The debiased EMA of `values` (see `EmaCache`), computed once. */
export function ema(values: ArrayLike<number>, weight: number): Float64Array {
  return new EmaCache().update(values, weight).slice();
}

/** Appends the sorted, distinct picks of one bucket: its first index, each series'
 * minimum and maximum, and its first gap (so a gap survives decimation). */
function pickBucket(lo: number, hi: number, ys: ReadonlyArray<ArrayLike<number>>,
  out: number[]): void {
  const picks = [lo];
  for (const y of ys) {
    let iMin = -1;
    let iMax = -1;
    let vMin = Infinity;
    let vMax = -Infinity;
    let iGap = -1;
    for (let i = lo; i < hi; i++) {
      const v = y[i];
      if (v === GAP) {
        iGap = iGap < 0 ? i : iGap;
        continue;
      }
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
    if (iGap >= 0) {
      picks.push(iGap);
    }
  }
  picks.sort((a, b) => a - b);
  for (const i of picks) {
    if (i !== out[out.length - 1]) {
      out.push(i); // buckets are disjoint and in order, so `out` stays sorted
    }
  }
}

/**
 * Min-max decimation of append-only series, incremental: indices to draw at most about
 * `maxPoints` points per series without losing spikes. The index range is cut into
 * buckets of a power-of-two size; each bucket keeps its first index and every series'
 * minimum and maximum. Complete buckets are computed once and kept; only the newest,
 * partial bucket is recomputed on each call (the bucket size doubles as the series
 * grows, which recomputes everything once per doubling).
 */
export class Decimator {
  private _size = 0;
  private _done = 0; // indices below this are covered by complete buckets in _picks
  private _picks: number[] = [];
  private _key = '';

  indices(length: number, ys: ReadonlyArray<ArrayLike<number>>, maxPoints: number): number[] {
    if (length <= maxPoints || maxPoints < 4) {
      return Array.from({ length }, (_, i) => i);
    }
    const buckets = Math.max(1, Math.floor(maxPoints / (1 + 2 * Math.max(ys.length, 1))));
    let size = 2;
    while (Math.ceil(length / size) > buckets) {
      size *= 2;
    }
    const key = `${ys.length}:${maxPoints}:${size}`;
    if (key !== this._key || length < this._done) {
      this._key = key;
      this._size = size;
      this._done = 0;
      this._picks = [];
    }
    while (this._done + this._size <= length) {
      pickBucket(this._done, this._done + this._size, ys, this._picks);
      this._done += this._size;
    }
    const out = this._picks.slice();
    if (this._done < length) {
      pickBucket(this._done, length, ys, out);
    }
    if (out[out.length - 1] !== length - 1) {
      out.push(length - 1); // the newest point is always drawn
    }
    return out;
  }

  /**
   * Gathers `x` and each series at the decimated indices (a gap -> null, which breaks
   * the line; NaN, a missing value -> undefined, joined across); `extra` series (a
   * smoothed copy) are gathered at the same indices without choosing them.
   */
  decimate(
    x: ArrayLike<number>,
    ys: ReadonlyArray<ArrayLike<number>>,
    maxPoints: number,
    extra: ReadonlyArray<ArrayLike<number>> = []
  ): Decimated {
    const idx = this.indices(x.length, ys, maxPoints);
    return {
      x: idx.map(i => x[i]),
      ys: [...ys, ...extra].map(y => idx.map(i => drawn(y[i])))
    };
  }
}

/**
 * `indices` with every index where `sparse` has a finite value added (in order): a
 * series logged every N steps (the held-out loss) keeps all its points however the
 * dense series around it are decimated.
 */
export function withSparse(indices: number[], sparse: ArrayLike<number>): number[] {
  const extra: number[] = [];
  for (let i = 0; i < sparse.length; i += 1) {
    if (Number.isFinite(sparse[i])) {
      extra.push(i);
    }
  }
  if (!extra.length) {
    return indices;
  }
  return Array.from(new Set([...indices, ...extra])).sort((a, b) => a - b);
}

/** A column value as a chart draws it: itself, null (a gap) or undefined (missing). */
export function drawn(v: number): number | null | undefined {
  return Number.isFinite(v) ? v : v === GAP ? null : undefined;
}

/** Indices of a one-off min-max decimation (see `Decimator`). */
export function decimateIndices(
  length: number,
  ys: ReadonlyArray<ArrayLike<number>>,
  maxPoints: number
): number[] {
  return new Decimator().indices(length, ys, maxPoints);
}

/** A one-off min-max decimation of `x` and `ys` (see `Decimator`). */
export function decimate(
  x: ArrayLike<number>,
  ys: ReadonlyArray<ArrayLike<number>>,
  maxPoints: number
): Decimated {
  return new Decimator().decimate(x, ys, maxPoints);
}
