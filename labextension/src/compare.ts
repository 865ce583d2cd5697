/** Several runs on one chart (main area): one metric, one line per run, live. */
import { Widget } from '@lumino/widgets';
import uPlot from 'uplot';

import { LineChart, PALETTE } from './chart';
import { el } from './dom';
import { fmtRate, fmtSeconds } from './format';
import { runStream, Stream } from './handler';
import { RunModel } from './runModel';
import { Decimator, EmaCache } from './series';
import { SettingsModel } from './settings';
import { Throttle } from './throttle';
import { RunMessage } from './types';

/** Metrics a comparison can show, with their tick format. */
export const COMPARABLE: Record<string, { label: string; format?: (v: number) => string }> = {
  loss: { label: 'loss (smoothed)' },
  mfu: { label: 'MFU', format: v => `${(v * 100).toFixed(1)}%` },
  mfu_fp8: { label: 'MFU (fp8 peak)', format: v => `${(v * 100).toFixed(1)}%` },
  hfu: { label: 'HFU', format: v => `${(v * 100).toFixed(1)}%` },
  tokens_per_s: { label: 'tokens/s', format: fmtRate },
  step_time: { label: 'step time', format: fmtSeconds }
};

export class CompareRuns extends Widget {
  readonly runs: RunModel[];
  private _streams: Stream<RunMessage>[];
  private _metric = 'loss';
  private _chart: LineChart | null = null;
  private _box = el('div', 'jp-Workbench-compareChart');
  private _throttle: Throttle;
  private _names = '';
  private _decimators: Decimator[] = [];
  private _emas: EmaCache[] = [];

  constructor(readonly ids: string[], private readonly _settings: SettingsModel) {
    super();
    this.addClass('jp-Workbench-compare');
    this.id = `workbench-compare-${ids.map(encodeURIComponent).join('+')}`;
    this.title.label = `Compare ${ids.length} runs`;
    this.title.caption = ids.join(', ');
    this.title.closable = true;
    const select = document.createElement('select');
    for (const [key, m] of Object.entries(COMPARABLE)) {
      const opt = document.createElement('option');
      opt.value = key;
      opt.textContent = m.label;
      select.append(opt);
    }
    select.addEventListener('change', () => {
      this._metric = select.value;
      this._rebuild();
    });
    const tools = el('div', 'jp-Workbench-tools');
    tools.append(el('span', '', 'metric'), select);
    this.node.append(tools, this._box);
    this._throttle = new Throttle(() => this.render(), () => _settings.value.refreshRate);
    this.runs = ids.map(id => new RunModel(id));
    this._streams = this.runs.map(run => {
      run.changed.connect((_, change) => {
        if (change === 'reset' || (change === 'detail' && this._names !== this._currentNames())) {
          this._rebuild(); // a legend label (run name) changed, or a run's file was replaced
        } else {
          this._throttle.schedule();
        }
      });
      return runStream(run.id, () => run.series.lastStep ?? -1, m => run.apply(m),
        Object.keys(COMPARABLE));
    });
    _settings.changed.connect(this._onSettings, this);
    this._rebuild();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._streams.forEach(s => s.dispose());
    this._throttle.dispose();
    this._chart?.dispose();
    this._settings.changed.disconnect(this._onSettings, this);
    super.dispose();
  }

  /**
   * Redraws: each run decimated on its own steps, then joined on the union of steps.
   * The chart element carries `data-raw-points` and `data-series-points` (per run).
   */
  render(): void {
    if (!this._chart) {
      return;
    }
    const t0 = performance.now();
    const per = Math.max(100, Math.floor(this._settings.value.maxPoints));
    const tables = this.runs.map((run, i) => {
      const s = run.series;
      let y: ArrayLike<number> = s.column(this._metric);
      if (this._metric === 'loss') {
        y = this._emas[i].update(y, this._settings.value.smoothing);
      }
      const d = this._decimators[i].decimate(s.column('step'), [y], per);
      return [d.x, d.ys[0]] as uPlot.AlignedData;
    });
    const joined = tables.length ? uPlot.join(tables) : [[]];
    this._chart.setData(joined[0] as number[],
      joined.slice(1) as (number | null | undefined)[][], t0);
    this._chart.node.dataset.rawPoints = this.runs.map(r => r.series.length).join(',');
    this._chart.node.dataset.seriesPoints = joined.slice(1)
      .map(y => (y as (number | null)[]).filter(v => v !== null && v !== undefined).length)
      .join(',');
  }

  private _onSettings(): void {
    this._throttle.schedule();
  }

  private _currentNames(): string {
    return JSON.stringify(this.runs.map(r => r.name));
  }

  private _rebuild(): void {
    this._chart?.dispose();
    this._decimators = this.runs.map(() => new Decimator()); // per run, for this metric
    this._emas = this.runs.map(() => new EmaCache());
    this._names = this._currentNames();
    const m = COMPARABLE[this._metric];
    this._chart = new LineChart({
      title: m.label,
      height: 360,
      format: m.format ? { y: m.format } : undefined,
      series: this.runs.map((run, i) => ({ label: run.name, stroke: PALETTE[i % PALETTE.length] }))
    });
    this._chart.node.classList.add('jp-Workbench-compareLines');
    this._box.replaceChildren(this._chart.node);
    this.render();
  }
}
