import { decimate, decimateIndices, Decimator, ema, EmaCache, GAP, MetricSeries, withSparse } from '../series';

describe('MetricSeries', () => {
  it('appends columns, fills missing values with NaN and drops re-logged steps', () => {
    const s = new MetricSeries();
    expect(s.append({ step: [1, 2, 3], loss: [3, 2, null], peak_source: ['table', 'table', 'table'] })).toBe(3);
    expect(s.append({ step: [3, 4], mfu: [0.5, 0.25] })).toBe(1); // step 3 again: dropped
    expect(Array.from(s.column('step'))).toEqual([1, 2, 3, 4]);
    expect(Array.from(s.column('loss'))).toEqual([3, 2, NaN, NaN]);
    expect(Array.from(s.column('mfu'))).toEqual([NaN, NaN, NaN, 0.25]);
    expect(s.keys().sort()).toEqual(['loss', 'mfu', 'step']); // text columns are not stored
    expect(s.last('loss')).toBe(2);
    expect(s.lastStep).toBe(4);
    expect(s.has('mfu') && !s.has('hfu')).toBe(true);
  });

  it('stores the rows the server lists in gaps as GAP, other nulls as missing', () => {
    const s = new MetricSeries();
    // the server: loss NaN at step 2 (a gap), no loss at step 3 (missing), step 1 re-sent
    expect(s.append({ step: [1], loss: [4] })).toBe(1);
    expect(s.append({ step: [1, 2, 3, 4], loss: [4, null, null, 1], mfu: [null, null, 0.5, null] },
      { loss: [1], mfu: [0] })).toBe(3);
    expect(Array.from(s.column('loss'))).toEqual([4, GAP, NaN, 1]);
    expect(Array.from(s.column('mfu'))).toEqual([NaN, NaN, 0.5, NaN]); // the gap was step 1's
    expect(s.last('loss')).toBe(1);
    const only = new MetricSeries();
    only.append({ step: [1, 2], hfu: [null, null] }, { hfu: [1] }); // a column of gaps only
    expect(Array.from(only.column('hfu'))).toEqual([NaN, GAP]);
    expect(only.has('hfu')).toBe(false);
    expect(Array.from(ema([2, GAP, 4], 0.5))[1]).toBe(GAP); // smoothing keeps the gap
  });

  it('grows past its initial capacity without losing values', () => {
    const s = new MetricSeries();
    const n = 10000;
    for (let i = 0; i < n; i += 1000) {
      const step = Array.from({ length: 1000 }, (_, k) => i + k + 1);
      s.append({ step, loss: step.map(v => 1 / v) });
    }
    expect(s.length).toBe(n);
    const loss = s.column('loss');
    expect(loss[0]).toBe(1);
    expect(loss[n - 1]).toBeCloseTo(1 / n, 12);
    s.clear();
    expect(s.length).toBe(0);
    expect(s.lastStep).toBeNull();
  });
});

describe('ema', () => {
  it('matches a hand-computed debiased moving average', () => {
    // w = 0.5: m1 = 0.5*2 = 1 -> 1/(1-0.5) = 2; m2 = 0.5*1 + 0.5*4 = 2.5 -> 2.5/0.75
    const out = ema([2, 4, NaN, 6], 0.5);
    expect(out[0]).toBeCloseTo(2);
    expect(out[1]).toBeCloseTo(2.5 / 0.75);
    expect(out[2]).toBeNaN();
    expect(out[3]).toBeCloseTo((0.5 * 2.5 + 0.5 * 6) / (1 - 0.125));
    expect(Array.from(ema([1, 5, 3], 0))).toEqual([1, 5, 3]);
  });

  it('updates incrementally to the same values as computed at once', () => {
    const values = Array.from({ length: 5000 }, (_, i) => Math.cos(i / 7) + (i % 13 === 0 ? NaN : 0));
    const cache = new EmaCache();
    for (let n = 0; n <= values.length; n += 777) {
      cache.update(values.slice(0, n), 0.9);
    }
    const whole = ema(values, 0.9);
    expect(Array.from(cache.update(values, 0.9))).toEqual(Array.from(whole));
    expect(Array.from(cache.update(values, 0.5))).toEqual(Array.from(ema(values, 0.5)));
  });
});

describe('decimate', () => {
  it('keeps every point when under the limit', () => {
    expect(decimateIndices(5, [[1, 2, 3, 4, 5]], 10)).toEqual([0, 1, 2, 3, 4]);
  });

  it('stays near the limit and keeps spikes, extremes and the newest point', () => {
    const n = 100000;
    const x = Float64Array.from({ length: n }, (_, i) => i + 1);
    const y = Float64Array.from({ length: n }, (_, i) => Math.sin(i / 500));
    y[54321] = 100; // a spike
    y[77777] = -50;
    const d = decimate(x, [y], 2000);
    expect(d.x.length).toBeLessThanOrEqual(2001);
    expect(d.x.length).toBeGreaterThan(600);
    expect(d.x).toContain(54322);
    expect(Math.max(...(d.ys[0] as number[]))).toBe(100);
    expect(Math.min(...(d.ys[0] as number[]))).toBe(-50);
    expect(d.x[d.x.length - 1]).toBe(n);
    expect([...d.x].sort((a, b) => a - b)).toEqual(d.x); // still in step order
  });

  it('gives the same picks incrementally as from scratch, as the series grows', () => {
    const n = 60000;
    const y = Float64Array.from({ length: n }, (_, i) => Math.sin(i / 300) + ((i * 7919) % 101) / 50);
    const inc = new Decimator();
    for (let len = 1; len <= n; len += 997) {
      const got = inc.indices(len, [y.subarray(0, len)], 1500);
      expect(got).toEqual(new Decimator().indices(len, [y.subarray(0, len)], 1500));
      expect(got.length).toBeLessThanOrEqual(1501);
    }
  });

  it('gathers extra series at the chosen indices', () => {
    const d = new Decimator().decimate([1, 2, 3], [[5, 6, 7]], 10, [[0.5, NaN, 0.7]]);
    expect(d.ys).toEqual([[5, 6, 7], [0.5, undefined, 0.7]]);
  });

  it('draws gaps as null (the line breaks) and missing values as undefined (joined)', () => {
    expect(decimate([1, 2, 3], [[NaN, GAP, 1]], 10).ys[0]).toEqual([undefined, null, 1]);
  });

  it('keeps a gap through decimation without hiding the bucket extremes', () => {
    const y = Array.from({ length: 4000 }, (_, i) => Math.sin(i / 50));
    y[1234] = GAP;
    y[3000] = 9; // a spike
    const d = decimate(y.map((_, i) => i), [y], 200);
    expect(d.x).toContain(1234);
    expect(d.ys[0][d.x.indexOf(1234)]).toBeNull();
    expect(d.ys[0][d.x.indexOf(3000)]).toBe(9);
    expect(Math.min(...(d.ys[0].filter(v => typeof v === 'number') as number[])))
      .toBeCloseTo(Math.min(...y.filter(Number.isFinite)), 6);
  });
});

describe('withSparse', () => {
  it('keeps every point of a series logged every N steps through any decimation', () => {
    const n = 10000;
    const loss = Float64Array.from({ length: n }, (_, i) => Math.sin(i / 50) + i / n);
    const evalLoss = Float64Array.from({ length: n }, (_, i) => ((i + 1) % 500 === 0 ? 1 - i / n : NaN));
    const dense = decimateIndices(n, [loss], 200);
    const idx = withSparse(dense, evalLoss);
    const evalAt = Array.from({ length: n / 500 }, (_, k) => 500 * k + 499);
    expect(evalAt.every(i => idx.includes(i))).toBe(true);       // all 20 eval points
    expect(dense.every(i => idx.includes(i))).toBe(true);        // and the decimated ones
    expect(idx).toEqual([...idx].sort((a, b) => a - b));         // in order, no repeats
    expect(new Set(idx).size).toBe(idx.length);
    expect(withSparse(dense, new Float64Array(n).fill(NaN))).toBe(dense);   // none: as is
  });
});
