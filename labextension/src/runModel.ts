/** One run as a dashboard or comparison sees it: its run.json and its metric columns. */
import { ISignal, Signal } from '@lumino/signaling';

import { IPrediction, parsePrediction } from './prediction';
import { MetricSeries } from './series';
import { RunDetail, RunMessage } from './types';

/** What changed: the run's metadata, its metrics, or everything (reset). */
export type RunChange = 'detail' | 'metrics' | 'reset';

export class RunModel {
  readonly series = new MetricSeries();
  private _detail: RunDetail | null = null;
  private _prediction: IPrediction | null = null;
  private _changed = new Signal<this, RunChange>(this);

  constructor(readonly id: string) {}

  /** Emitted after every applied message that changed something. */
  get changed(): ISignal<this, RunChange> {
    return this._changed;
  }

  /** The run's `run.json` (null until the first message). */
  get detail(): RunDetail | null {
    return this._detail;
  }

  /** The plan's predicted step (checked), or null for runs not started from a plan. */
  get prediction(): IPrediction | null {
    return this._prediction;
  }

  /** Display name: run.json's name, else the id. */
  get name(): string {
    return this._detail?.name || this.id;
  }

  /** Seconds the last compile took (from the `compile` event), if known. */
  get compileSeconds(): number | null {
    const ev = (this._detail?.events ?? []).filter(e => e.event === 'compile');
    const last = ev[ev.length - 1];
    return last && typeof last['seconds'] === 'number' ? (last['seconds'] as number) : null;
  }

  /** Applies one run-stream message (or a REST metrics page shaped the same). */
  apply(msg: RunMessage): void {
    if (msg.type === 'run') {
      this._detail = msg.run;
      this._prediction = parsePrediction(msg.run?.prediction);
      this._changed.emit('detail');
    } else if (msg.type === 'metrics') {
      if (this.series.append(msg.columns, msg.gaps)) {
        this._changed.emit('metrics');
      }
    } else if (msg.type === 'reset') {
      this.series.clear();
      this._changed.emit('reset');
    }
  }
}
