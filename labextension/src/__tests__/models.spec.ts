import { RunModel } from '../runModel';
import { RunsModel } from '../runsModel';
import { RunDetail, RunSummary } from '../types';

function summary(id: string, updated: number, status = 'running'): RunSummary {
  return {
    id, uid: null, name: id, status, step: 1, target_steps: null, created: 0, updated,
    config_hash: null, device_kind: null, peak_source: null, points: 1, loss: 1, mfu: 0.3,
    hfu: null, tokens_per_s: null, step_time: null, spark: { step: [1], loss: [1] }
  };
}

describe('RunsModel', () => {
  it('applies the full list, updates and removals, newest first', () => {
    const m = new RunsModel();
    let changes = 0;
    m.changed.connect(() => changes++);
    m.apply({ type: 'runs', runs: [summary('a', 1, 'finished'), summary('b', 2)], total: 2, next: null });
    expect(m.runs.map(r => r.id)).toEqual(['b', 'a']);
    m.apply({ type: 'update', runs: [{ ...summary('a', 3), step: 7 }, summary('c', 0)] });
    expect(m.runs.map(r => r.id)).toEqual(['a', 'b', 'c']);
    expect(m.get('a')?.step).toBe(7);
    expect(m.latestRunning()?.id).toBe('a');
    m.apply({ type: 'removed', ids: ['a', 'zzz'] });
    expect(m.runs.map(r => r.id)).toEqual(['b', 'c']);
    expect(changes).toBe(3);
  });

  it('counts the runs of later pages and adds each page once', () => {
    const m = new RunsModel();
    m.apply({ type: 'runs', runs: [summary('a', 5), summary('b', 4)], total: 5, next: 'c1' });
    expect([m.remaining, m.next]).toEqual([3, 'c1']);
    m.apply({ type: 'update', runs: [summary('e', 9)] });   // a run of a later page changed
    expect(m.remaining).toBe(2);
    m.addPage({ runs: [summary('c', 3), summary('e', 9)], total: 5, next: 'c2' });
    expect(m.runs.map(r => r.id)).toEqual(['e', 'a', 'b', 'c']);
    expect(m.remaining).toBe(1);
    m.addPage({ runs: [summary('d', 2)], total: 5, next: null });
    expect([m.runs.length, m.remaining, m.next]).toEqual([5, 0, null]);
  });

  it('keeps names as given (the views render them as text)', () => {
    const m = new RunsModel();
    const evil = '<img src=x onerror=alert(1)>';
    m.apply({ type: 'runs', runs: [{ ...summary('x', 1), name: evil }], total: 1, next: null });
    expect(m.get('x')?.name).toBe(evil);
  });
});

describe('RunModel', () => {
  it('follows run, metrics and reset messages', () => {
    const m = new RunModel('runs/a');
    const seen: string[] = [];
    m.changed.connect((_, c) => seen.push(c));
    const detail = { id: 'runs/a', uid: 'u', name: 'A', status: 'running', step: 0,
      target_steps: 30, config: {}, events: [{ event: 'compile', seconds: 2.5 }] } as RunDetail;
    m.apply({ type: 'run', run: detail });
    expect(m.name).toBe('A');
    expect(m.compileSeconds).toBe(2.5);
    m.apply({ type: 'metrics', id: 'runs/a', count: 2, last_step: 2,
      columns: { step: [1, 2], loss: [4, 3] } });
    m.apply({ type: 'metrics', id: 'runs/a', count: 1, last_step: 2,
      columns: { step: [2], loss: [9] } }); // a duplicate: no change
    expect(Array.from(m.series.column('loss'))).toEqual([4, 3]);
    m.apply({ type: 'reset' });
    expect(m.series.length).toBe(0);
    expect(seen).toEqual(['detail', 'metrics', 'reset']);
  });
});
