import { Throttle } from '../throttle';

describe('Throttle', () => {
  beforeAll(() => {
    // jest's node environment has no `window` and no animation frames: stand-ins that
    // the fake timers below then replace with their own
    const g = globalThis as unknown as { window: typeof globalThis; requestAnimationFrame: unknown };
    g.window = globalThis;
    g.requestAnimationFrame = (cb: (t: number) => void) => setTimeout(() => cb(performance.now()), 16);
  });
  beforeEach(() => {
    jest.useFakeTimers(); // setTimeout, requestAnimationFrame and performance.now
    jest.advanceTimersByTime(10_000);
  });
  afterEach(() => jest.useRealTimers());

  it('folds the calls of one interval into one run, at most one run per interval', () => {
    let runs = 0;
    let interval = 250;
    const throttle = new Throttle(
      () => (runs += 1),
      () => interval
    );
    throttle.schedule();
    throttle.schedule();
    jest.advanceTimersByTime(20); // nothing ran lately: at the next frame
    expect(runs).toBe(1);
    throttle.schedule();
    throttle.schedule();
    jest.advanceTimersByTime(150);
    expect(runs).toBe(1); // within 250 ms of the last run: waits
    jest.advanceTimersByTime(150);
    expect(runs).toBe(2); // then one run for both calls
    interval = 1000; // the interval is read on every call
    throttle.schedule();
    jest.advanceTimersByTime(500);
    expect(runs).toBe(2);
    jest.advanceTimersByTime(600);
    expect(runs).toBe(3);
  });

  it('never runs a call pending when it is disposed', () => {
    let runs = 0;
    const throttle = new Throttle(
      () => (runs += 1),
      () => 250
    );
    throttle.schedule();
    jest.advanceTimersByTime(20);
    throttle.schedule();
    throttle.dispose();
    jest.advanceTimersByTime(1000);
    expect(runs).toBe(1);
  });
});
