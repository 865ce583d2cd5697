/** The Workbench side panel: every run with live status, step, loss, MFU and a sparkline. */
import { Widget } from '@lumino/widgets';

import { button, el } from './dom';
import { fmtNumber, fmtPercent, fmtStep } from './format';
import { predictionHint } from './prediction';
import { RunsModel } from './runsModel';
import { SettingsModel } from './settings';
import { drawSparkline } from './sparkline';
import { Throttle } from './throttle';
import { RunSummary } from './types';

/** One row's elements, kept so updates touch text only (names are always textContent). */
interface IRow {
  node: HTMLLIElement;
  check: HTMLInputElement;
  name: HTMLSpanElement;
  status: HTMLSpanElement;
  problem: HTMLSpanElement;
  step: HTMLSpanElement;
  loss: HTMLSpanElement;
  mfu: HTMLSpanElement;
  pred: HTMLSpanElement;
  spark: HTMLCanvasElement;
}

export interface IRunsPanelOptions {
  model: RunsModel;
  settings: SettingsModel;
  openRun: (id: string) => void;
  compare: (ids: string[]) => void;
  refresh: () => void;
  /** Fetches the next page of the runs list (the model's `next`) into the model. */
  loadMore: () => Promise<void>;
}

export class RunsPanel extends Widget {
  private _rows = new Map<string, IRow>();
  private _list: HTMLUListElement;
  private _empty: HTMLDivElement;
  private _state: HTMLSpanElement;
  private _compareBtn: HTMLButtonElement;
  private _more: HTMLButtonElement;
  private _throttle: Throttle;

  constructor(private readonly _o: IRunsPanelOptions) {
    super();
    this.id = 'workbench-runs';
    this.addClass('jp-Workbench-panel');
    this.title.caption = 'Workbench runs';
    const head = el('div', 'jp-Workbench-panelHead');
    head.append(el('span', 'jp-Workbench-panelTitle', 'Runs'));
    this._state = el('span', 'jp-Workbench-connection', 'connecting…');
    this._compareBtn = button('Compare', 'Compare the checked runs on one chart', () =>
      this._o.compare(this.selected()));
    head.append(this._state, this._compareBtn, button('↻', 'Reload the runs list', _o.refresh));
    this._list = el('ul', 'jp-Workbench-runList');
    this._empty = el('div', 'jp-Workbench-empty',
      'No runs yet. Train with wb.Trainer(..., run_dir="runs/name") under this server\'s ' +
      'root, or launch a job: its run directory appears here.');
    this._more = button('', 'Load the next page of the runs list', () => void this._loadMore());
    this._more.classList.add('jp-Workbench-moreRuns');
    this.node.append(head, this._empty, this._list, this._more);
    this._throttle = new Throttle(() => this.render(), () => _o.settings.value.refreshRate);
    _o.model.changed.connect(() => this._throttle.schedule());
    this.render();
  }

  /** Ids of the checked runs. */
  selected(): string[] {
    return [...this._rows.entries()].filter(([, r]) => r.check.checked).map(([id]) => id);
  }

  /** Brings the DOM up to date with the model (keyed by run id). */
  render(): void {
    const runs = this._o.model.runs;
    this._state.textContent = this._o.model.connected ? 'live' : 'offline';
    this._state.classList.toggle('jp-mod-live', this._o.model.connected);
    this._empty.hidden = runs.length > 0;
    const seen = new Set<string>();
    runs.forEach((run, i) => {
      seen.add(run.id);
      const row = this._rows.get(run.id) ?? this._makeRow(run.id);
      this._update(row, run);
      if (this._list.children[i] !== row.node) {
        this._list.insertBefore(row.node, this._list.children[i] ?? null);
      }
    });
    for (const [id, row] of this._rows) {
      if (!seen.has(id)) {
        row.node.remove();
        this._rows.delete(id);
      }
    }
    this._compareBtn.disabled = this.selected().length < 1;
    const more = this._o.model.remaining;
    this._more.hidden = more === 0;
    this._more.dataset.remaining = String(more);
    if (!this._more.disabled) {
      this._more.textContent = `${more} more…`;
    }
  }

  /** One page more; the button says so while it loads, and why when it fails. */
  private async _loadMore(): Promise<void> {
    this._more.disabled = true;
    this._more.textContent = 'loading…';
    try {
      await this._o.loadMore();
      this._more.disabled = false;
    } catch (reason) {
      this._more.disabled = false;
      this._more.textContent = `${this._o.model.remaining} more… (${String(reason)}; click to retry)`;
      return;
    }
    this.render();
  }

  protected onAfterShow(): void {
    this.render();
  }

  dispose(): void {
    this._throttle.dispose();
    super.dispose();
  }

  private _makeRow(id: string): IRow {
    const node = el('li', 'jp-Workbench-run');
    node.dataset.id = id;
    node.title = id;
    const check = document.createElement('input');
    check.type = 'checkbox';
    check.title = 'Select for comparison';
    check.addEventListener('click', e => e.stopPropagation());
    check.addEventListener('change', () => (this._compareBtn.disabled = this.selected().length < 1));
    const name = el('span', 'jp-Workbench-runName');
    const status = el('span', 'jp-Workbench-status');
    const problem = el('span', 'jp-Workbench-problemBadge', '!');
    problem.hidden = true;
    const step = el('span', 'jp-Workbench-step');
    const loss = el('span', 'jp-Workbench-loss');
    const mfu = el('span', 'jp-Workbench-mfu');
    const pred = el('span', 'jp-Workbench-pred', 'pred.');
    pred.hidden = true;
    const spark = el('canvas', 'jp-Workbench-spark');
    const top = el('div', 'jp-Workbench-runTop');
    top.append(check, status, problem, name);
    const stats = el('div', 'jp-Workbench-runStats');
    stats.append(step, loss, mfu, pred, spark);
    node.append(top, stats);
    node.addEventListener('click', () => this._o.openRun(id));
    const row = { node, check, name, status, problem, step, loss, mfu, pred, spark };
    this._rows.set(id, row);
    return row;
  }

  /** Updates a row's text; `data-step`/`data-drawn-at` record when a new step showed. */
  private _update(row: IRow, run: RunSummary): void {
    if (row.node.dataset.step !== String(run.step)) {
      row.node.dataset.step = String(run.step);
      row.node.dataset.drawnAt = String(Date.now());
    }
    row.name.textContent = run.name;
    row.status.textContent = run.status;
    row.status.dataset.status = run.status;
    row.step.textContent = fmtStep(run.step, run.target_steps);
    row.loss.textContent = `loss ${fmtNumber(run.loss)}`;
    row.mfu.textContent = `MFU ${fmtPercent(run.mfu)}` +
      (typeof run.mfu_fp8 === 'number' ? ` (fp8 peak ${fmtPercent(run.mfu_fp8)})` : '');
    const hint = predictionHint(run.prediction);
    row.mfu.title = [run.peak_source ? `peak FLOP/s: ${run.peak_source}` : '', hint]
      .filter(Boolean).join('\n');
    row.pred.hidden = !hint;
    row.pred.title = hint;
    // a run with something unreadable: an error badge whose title is the reason
    const problem = typeof run.problem === 'string' ? run.problem : '';
    row.problem.hidden = !problem;
    row.problem.title = problem;
    row.node.classList.toggle('jp-mod-problem', !!problem);
    row.node.title = [run.id, hint, problem].filter(Boolean).join('\n');
    drawSparkline(row.spark, run.spark.loss);
  }
}
