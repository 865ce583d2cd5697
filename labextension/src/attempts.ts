/**
 * A restarted run's earlier attempts (`Trainer(..., restart="ok")`): run.json's history
 * keeps each ended attempt's loss curve in its `restart` entry (`ended`: attempt, step,
 * loss; at most 256 points). The loss chart draws each as a trace of its own ("attempt 1")
 * beside the current attempt, whose steps the run stream sends. Framework-free (jest).
 */

/** One earlier attempt's loss curve, checked. */
export interface IAttemptCurve {
  attempt: number;
  step: number[];
  loss: (number | null)[];
}

const isCount = (v: unknown): v is number => Number.isInteger(v) && (v as number) >= 1;

/** The attempt the run is at (run.json's `attempt`; 1 when absent or not a count). */
export function currentAttempt(attempt: unknown): number {
  return isCount(attempt) ? attempt : 1;
}

/**
 * The earlier attempts a run.json `history` records, oldest first: each `restart` entry's
 * `ended` curve whose steps are integers and whose losses are numbers or null (a gap),
 * one per attempt (the last entry wins); anything else is left out.
 */
export function earlierAttempts(history: unknown): IAttemptCurve[] {
  const found = new Map<number, IAttemptCurve>();
  for (const entry of Array.isArray(history) ? history : []) {
    const ended = (entry as { event?: unknown; ended?: unknown } | null)?.event === 'restart'
      ? (entry as { ended?: unknown }).ended : null;
    const c = ended as { attempt?: unknown; step?: unknown; loss?: unknown } | null;
    if (!c || !isCount(c.attempt) || !Array.isArray(c.step) || !Array.isArray(c.loss)
      || c.step.length !== c.loss.length || !c.step.every(Number.isInteger)) {
      continue;
    }
    const loss = c.loss.map(v => (typeof v === 'number' && Number.isFinite(v) ? v : null));
    found.set(c.attempt, { attempt: c.attempt, step: c.step as number[], loss });
  }
  return [...found.values()].sort((a, b) => a.attempt - b.attempt);
}

/**
 * Chart data with the earlier attempts added as series of their own: x becomes the sorted
 * union of `x` and their steps; `ys` and each attempt's loss are placed on it (undefined,
 * joined across, where a series has no point at that step).
 */
export function withAttempts(x: ArrayLike<number>, ys: (number | null | undefined)[][],
  earlier: IAttemptCurve[]): { x: number[]; ys: (number | null | undefined)[][] } {
  const steps = new Set<number>(Array.from(x));
  earlier.forEach(a => a.step.forEach(s => steps.add(s)));
  const all = [...steps].sort((a, b) => a - b);
  const at = new Map(all.map((s, i) => [s, i]));
  const place = (xs: ArrayLike<number>, vs: ArrayLike<number | null | undefined>) => {
    const out: (number | null | undefined)[] = new Array(all.length).fill(undefined);
    for (let i = 0; i < xs.length; i++) {
      out[at.get(xs[i]) as number] = vs[i];
    }
    return out;
  };
  return { x: all, ys: [...ys.map(y => place(x, y)), ...earlier.map(a => place(a.step, a.loss))] };
}
