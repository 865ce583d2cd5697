/** Redraw throttling: many model changes, at most one redraw per interval. */

/**
 * Runs `fn` at most once per `interval()` ms, on an animation frame; calls arriving
 * in between are folded into one.
 */
export class Throttle {
  private _last = 0;
  private _pending = 0;

  constructor(
    private readonly _fn: () => void,
    private readonly _interval: () => number
  ) {}

  schedule(): void {
    if (this._pending) {
      return;
    }
    const wait = Math.max(0, this._last + this._interval() - performance.now());
    this._pending = window.setTimeout(() => {
      requestAnimationFrame(() => {
        this._pending = 0;
        this._last = performance.now();
        this._fn();
      });
    }, wait);
  }

  dispose(): void {
    window.clearTimeout(this._pending);
  }
}
