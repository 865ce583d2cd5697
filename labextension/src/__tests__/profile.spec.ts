import { largestDisagreement, overheadText, parseProfiles } from '../profile';

// What GET .../runs/<id>/profiles answers (workbench/server/profiles.py), one malformed row
const ANSWER = {
  id: 'runs/a',
  profiles: [{
    name: '6', step: 6, verdict: 'largest disagreement: memory took 30 ms per step',
    plan_name: 'fsdp_tp', steps: 3, calibrated: false, problem: null,
    tokens_per_s: { outside: 5200, during: 5000 },
    rows: [
      { name: 'compute', predicted: 0.01, measured: 0.012, kind: '', axes: [], count: 0 },
      { name: 'memory', predicted: 0.01, measured: 0.03 },
      { name: 'all-reduce over data', predicted: 0.004, measured: 0.002, kind: 'all-reduce',
        axes: ['data'], count: 4, wait: 0.001 },
      { name: 'broken', predicted: 'NaN', measured: null },
      { name: 'step', predicted: 0.02, measured: 0.06 }
    ],
    top_ops: [{ name: 'dot.1', category: 'compute', seconds: 0.004, source: 'gpt.py:12' },
      { name: 'bad', seconds: 'x' }]
  }, 'not a profile']
};

describe('profiles', () => {
  it('keeps checked rows and drops malformed ones', () => {
    const [p, q] = parseProfiles(ANSWER);
    expect(p.rows.map(r => r.name)).toEqual(['compute', 'memory', 'all-reduce over data', 'step']);
    expect(p.rows[2]).toMatchObject({ kind: 'all-reduce', axes: ['data'], count: 4, wait: 0.001 });
    expect(p.topOps).toHaveLength(1);
    expect(p.tokensPerS).toEqual({ outside: 5200, during: 5000 });
    expect(q.rows).toEqual([]);
    expect(parseProfiles(null)).toEqual([]);
    expect(parseProfiles({ profiles: 'x' })).toEqual([]);
  });

  it('names the term farthest from its prediction, never the step', () => {
    const [p] = parseProfiles(ANSWER);
    expect(largestDisagreement(p.rows)?.name).toBe('memory');
    expect(largestDisagreement([])).toBeNull();
  });

  it('says the overhead only when both rates are known', () => {
    const [p] = parseProfiles(ANSWER);
    expect(overheadText(p.tokensPerS)).toContain('profiler overhead +4%');
    expect(overheadText({ outside: null, during: 5000 })).toBe('');
  });
});
