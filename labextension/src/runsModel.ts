/** The runs list the side panel and status bar show, fed by list-stream messages. */
import { ISignal, Signal } from '@lumino/signaling';

import { ListMessage, RunsPage, RunSummary } from './types';

export class RunsModel {
  private _runs = new Map<string, RunSummary>();
  private _changed = new Signal<this, void>(this);
  private _connected = false;
  private _total = 0;
  private _next: string | null = null;

  /** Emitted after every applied message. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Whether the list stream is connected. */
  get connected(): boolean {
    return this._connected;
  }

  set connected(value: boolean) {
    if (value !== this._connected) {
      this._connected = value;
      this._changed.emit();
    }
  }

  /** Runs, most recently updated first (ties by id, so the order is stable). */
  get runs(): RunSummary[] {
    return [...this._runs.values()].sort(
      (a, b) => b.updated - a.updated || a.id.localeCompare(b.id)
    );
  }

  /** The cursor of the next page of the runs list, or null when every page is here. */
  get next(): string | null {
    return this._next;
  }

  /** How many runs the server lists that are not here yet (0 on the last page). */
  get remaining(): number {
    return this._next === null ? 0 : Math.max(this._total - this._runs.size, 1);
  }

  /** Adds a page fetched with `next` (runs already here are replaced, not doubled). */
  addPage(page: RunsPage): void {
    for (const r of page.runs) {
      this._runs.set(r.id, r);
    }
    this._total = page.total;
    this._next = page.next;
    this._changed.emit();
  }

  /** The run with this id, if listed. */
  get(id: string): RunSummary | undefined {
    return this._runs.get(id);
  }

  /** The most recently updated running run (the status bar's default). */
  latestRunning(): RunSummary | undefined {
    return this.runs.find(r => r.status === 'running');
  }

  /** Emits `changed` without a change (views re-render, e.g. the active run moved). */
  touch(): void {
    this._changed.emit();
  }

  /** Applies one list-stream message (full list, updates or removals). */
  apply(msg: ListMessage): void {
    if (msg.type === 'runs') {
      this._runs = new Map(msg.runs.map(r => [r.id, r]));
      this._total = msg.total;
      this._next = msg.next;
    } else if (msg.type === 'update') {
      for (const r of msg.runs) {
        this._runs.set(r.id, r);
      }
    } else if (msg.type === 'removed') {
      for (const id of msg.ids) {
        if (this._runs.delete(id)) {
          this._total = Math.max(this._total - 1, 0);
        }
      }
    } else {
      return;
    }
    this._changed.emit();
  }
}
