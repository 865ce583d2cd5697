import { currentAttempt, earlierAttempts, withAttempts } from '../attempts';

describe('earlier attempts of a restarted run', () => {
  const ended = (attempt: unknown, step: unknown, loss: unknown) =>
    ({ event: 'restart', attempt: 2, ended: { attempt, step, loss } });

  it('reads each restart entry\'s ended curve, oldest first, and skips bad ones', () => {
    const history = [
      { event: 'fork', source: '/runs/a' },
      ended(2, [1, 2, 3], [5, 4, null]),
      ended(1, [1, 2], [6, 'NaN']),
      ended(0, [1], [1]), ended(3, [1.5], [1]), ended(4, [1, 2], [1]), ended(5, 'x', []),
      null, 7
    ];
    expect(earlierAttempts(history)).toEqual([
      { attempt: 1, step: [1, 2], loss: [6, null] },
      { attempt: 2, step: [1, 2, 3], loss: [5, 4, null] }]);
    expect(earlierAttempts(undefined)).toEqual([]);
    expect(earlierAttempts({ restart: 1 })).toEqual([]);
  });

  it('takes the attempt from run.json, 1 when it is no count', () => {
    expect([currentAttempt(3), currentAttempt(undefined), currentAttempt(0),
      currentAttempt('2'), currentAttempt(1.5)]).toEqual([3, 1, 1, 1, 1]);
  });

  it('places every attempt on the union of their steps', () => {
    const earlier = [{ attempt: 1, step: [1, 2, 3, 4], loss: [6, 5, null, 3] }];
    const out = withAttempts([1, 2], [[4, 3.5], [4, 3.8]], earlier);
    expect(out.x).toEqual([1, 2, 3, 4]);
    expect(out.ys).toEqual([[4, 3.5, undefined, undefined], [4, 3.8, undefined, undefined],
      [6, 5, null, 3]]);
    expect(withAttempts([], [[]], []).x).toEqual([]);
  });
});
