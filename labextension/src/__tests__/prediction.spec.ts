import {
  bandRange,
  describeBand,
  describeTerms,
  fmtRatio,
  parseBand,
  parsePrediction,
  predictionHint,
  ratio,
  recentMedian,
  versus
} from '../prediction';
import { RunModel } from '../runModel';
import { RunDetail } from '../types';

const GOOD = {
  step_seconds: 0.02, mfu: 0.3, tokens_per_s: 12800, compiler_seconds: null, bound: 'compute',
  source: 'cpu-compiler', source_reason: 'compiled for the real mesh', hardware: 'cpu',
  plan_name: 'tiny', breakdown: { compute: 0.02, memory: 0.01, communication: 0,
    collectives: [{ kind: 'all-reduce' }] },
  sources: { flops: 'cpu-compiler cost analysis' }
};

describe('parsePrediction', () => {
  it('keeps the numbers and texts of a recorded prediction', () => {
    const p = parsePrediction(GOOD);
    expect(p).not.toBeNull();
    expect(p?.step_seconds).toBe(0.02);
    expect(p?.mfu).toBe(0.3);
    expect(p?.tokens_per_s).toBe(12800);
    expect(p?.compiler_seconds).toBeNull();
    expect(p?.source).toBe('cpu-compiler');
    expect(p?.plan_name).toBe('tiny');
    expect(p?.breakdown).toEqual({ compute: 0.02, memory: 0.01, communication: 0 });
  });

  it('drops what a hand-edited run.json may hold instead of numbers', () => {
    const p = parsePrediction({ step_seconds: 'fast', mfu: NaN, tokens_per_s: Infinity,
      compiler_seconds: -1, bound: 7, source: { x: 1 }, breakdown: 'no' });
    expect(p).toBeNull(); // neither a step time nor an MFU survives
    const q = parsePrediction({ step_seconds: true, mfu: 0.25, bound: ['x'],
      breakdown: { compute: 'a', memory: -2, communication: 0.001 } });
    expect(q?.step_seconds).toBeNull();
    expect(q?.mfu).toBe(0.25);
    expect(q?.bound).toBeNull();
    expect(q?.breakdown).toEqual({ communication: 0.001 });
    for (const bad of [null, undefined, 'x', 3, [GOOD], {}]) {
      expect(parsePrediction(bad)).toBeNull();
    }
    expect(parsePrediction({ step_seconds: 0.1, source: 'x'.repeat(10000) })?.source?.length)
      .toBe(500);
  });
});

describe('measured against predicted', () => {
  it('takes the median of the last finite values', () => {
    expect(recentMedian(new Float64Array([9, 1, 2, NaN, 3]), 3)).toBe(2); // 1, 2, 3
    expect(recentMedian(new Float64Array([5, NaN, 1, 2, 3, 4]), 4)).toBe(2.5);
    expect(recentMedian(new Float64Array([NaN]))).toBeNull();
    expect(recentMedian(new Float64Array([]))).toBeNull();
  });

  it('divides measured by predicted, and says so on the cards', () => {
    expect(ratio(0.03, 0.02)).toBeCloseTo(1.5);
    expect(ratio(null, 0.02)).toBeNull();
    expect(ratio(0.03, 0)).toBeNull();
    expect(fmtRatio(0.03 / 0.02)).toBe('1.5×');
    const p = parsePrediction(GOOD);
    const t = versus('step_time', 0.03, p);
    expect(t?.text).toBe('pred. 20 ms · measured 1.5×');
    expect(t?.title).toContain('predicted step time 20 ms (compute-bound)');
    expect(t?.title).toContain('plan tiny · cpu-compiler on cpu');
    const m = versus('mfu', 0.15, p);
    expect(m?.text).toBe('pred. 30.0% · measured 0.5×');
    expect(versus('mfu', null, p)?.text).toBe('pred. 30.0%');
    expect(versus('step_time', 0.03, null)).toBeNull();
    expect(versus('step_time', 0.03, parsePrediction({ mfu: 0.3 }))).toBeNull();
  });

  it('lists the terms, the host transfers only where something is offloaded', () => {
    const p = parsePrediction({
      step_seconds: 4, breakdown: { compute: 3, memory: 1, communication: 0.2,
        host_transfers: 0.5, host_link: 1.5 }
    });
    expect(p && describeTerms(p)).toBe('compute 3.00 s · HBM 1.00 s · communication 200 ms ' +
      'not hidden · host transfers 500 ms not hidden (of 1.50 s on the host link)');
    expect(versus('step_time', 4, p)?.title).toContain('host transfers 500 ms not hidden');
    const none = parsePrediction({ step_seconds: 4, breakdown: { compute: 3, host_link: 0 } });
    expect(none && describeTerms(none)).toBe('compute 3.00 s');
  });

  it('hints at a prediction in the runs list, and at nothing without one', () => {
    expect(predictionHint({ step_seconds: 0.02, mfu: 0.3, source: 'estimate' }))
      .toBe('pred. 20 ms/step · MFU 30.0% (estimate)');
    expect(predictionHint({ mfu: 0.3 })).toBe('pred. MFU 30.0%');
    expect(predictionHint(null)).toBe('');
    expect(predictionHint({ step_seconds: 'NaN' })).toBe('');
  });
});

describe('the error band', () => {
  const BAND = { low: 0.9, high: 1.2, basis: 'calibration',
    summary: 'from 3 calibration layouts, measured/predicted 0.90-1.20x',
    source: "the calibration's residuals" };

  it('shows the range on the cards, in the tooltip and in the runs list', () => {
    const p = parsePrediction({ ...GOOD, band: BAND });
    expect(p?.band?.low).toBe(0.9);
    // a time is the prediction x the factors, a rate the prediction / them
    expect(bandRange('step_time', 0.02, p?.band ?? null)).toBe('18 ms–24 ms');
    expect(bandRange('mfu', 0.3, p?.band ?? null)).toBe('25.0%–33.3%');
    const t = versus('step_time', 0.03, p);
    expect(t?.text).toBe('pred. 20 ms (18 ms–24 ms) · measured 1.5×');
    expect(t?.title).toContain('band 18 ms–24 ms, from 3 calibration layouts');
    expect(versus('mfu', null, p)?.text).toBe('pred. 30.0% (25.0%–33.3%)');
    expect(predictionHint({ ...GOOD, band: BAND }))
      .toBe('pred. 20 ms/step (18 ms–24 ms) · MFU 30.0% (cpu-compiler)');
  });

  it('says why there is no band, and drops a malformed one', () => {
    const none = parsePrediction({ ...GOOD, band: { low: null, high: null, basis: 'none',
      source: 'uncalibrated CPU: no measured basis' } });
    expect(none?.band?.low).toBeNull();
    expect(versus('step_time', 0.03, none)?.text).toBe('pred. 20 ms · measured 1.5×');
    expect(describeBand('step_time', 0.02, none?.band ?? null))
      .toBe('no band: uncalibrated CPU: no measured basis');
    // out of order, not finite, not numbers: no band, never a made-up one
    for (const bad of [{ low: 1.2, high: 0.9 }, { low: NaN, high: 1 }, { low: '0.9', high: 1 },
      { low: 0, high: 1 }, { low: true, high: 2 }]) {
      const b = parseBand(bad);
      expect(b?.low).toBeNull();
      expect(b?.high).toBeNull();
    }
    for (const bad of [null, 'x', [BAND], 3]) {
      expect(parseBand(bad)).toBeNull();
    }
    expect(parsePrediction(GOOD)?.band).toBeNull();   // an older run: no band recorded
    expect(describeBand('step_time', 0.02, null)).toBe('');
  });
});

describe('RunModel.prediction', () => {
  it('follows run.json and survives a malformed field', () => {
    const m = new RunModel('runs/p');
    const detail = { id: 'runs/p', uid: 'u', name: 'p', status: 'running', step: 0,
      target_steps: 10, config: {} } as RunDetail;
    m.apply({ type: 'run', run: detail });
    expect(m.prediction).toBeNull(); // an older run.json without the field
    m.apply({ type: 'run', run: { ...detail, prediction: GOOD } });
    expect(m.prediction?.step_seconds).toBe(0.02);
    m.apply({ type: 'run', run: { ...detail, prediction: { step_seconds: 'oops' } } });
    expect(m.prediction).toBeNull();
  });
});
