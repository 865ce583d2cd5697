// the DOM part (expertHeatmap) runs in the browser tests; jest runs in node
import { ExpertLoadModel, heatColour, relativeLoad } from '../expertLoad';

const page = (steps: number[], loads: unknown[]) => ({
  type: 'metrics' as const, id: 'r', count: steps.length, last_step: steps[steps.length - 1],
  columns: { step: steps, moe_tokens_per_expert: loads, moe_dropped: steps.map(() => 0),
    moe_entropy: steps.map(() => 1.5) }
});

describe('ExpertLoadModel', () => {
  it('appends loads per step, drops re-logged steps and rows without loads', () => {
    const m = new ExpertLoadModel();
    expect(m.apply(page([1, 2], [[[3, 1], [2, 2]], [[4, 0], [1, 3]]]))).toBe(true);
    expect(m.apply(page([2, 3, 4], [[[9, 9], [9, 9]], null, [[2, 2], [0, 4]]]))).toBe(true);
    expect(m.rows.map(r => r.step)).toEqual([1, 2, 4]);
    expect([m.layers, m.experts]).toEqual([2, 2]);
    m.apply({ type: 'reset' });
    expect(m.rows).toEqual([]);
  });

  it('gives load relative to balanced per layer and summed', () => {
    const m = new ExpertLoadModel();
    m.apply(page([1], [[[3, 1], [2, 2]]]));
    expect(relativeLoad(m.rows, 0)).toEqual([[1.5, 0.5]]);
    expect(relativeLoad(m.rows, 1)).toEqual([[1, 1]]);
    expect(relativeLoad(m.rows, -1)).toEqual([[1.25, 0.75]]);
  });

  it('colours balanced, idle and overloaded experts apart, clamped at 2x', () => {
    expect(heatColour(1)).toBe('rgb(45, 120, 230)');
    expect(new Set([heatColour(0), heatColour(1), heatColour(2)]).size).toBe(3);
    expect(heatColour(5)).toBe(heatColour(2));
    expect(heatColour(-1)).toBe(heatColour(0));
  });
});
