/**
 * A run's dashboard (main area): loss with smoothing, MFU and HFU, step-time breakdown,
 * tokens/s, memory per device and the config, live from the run stream. A run started
 * from a plan also shows the plan's prediction: under the step-time and MFU cards, and as
 * a dashed "predicted" line on the step-time and utilization charts. A profiled run
 * (`trainer.profile()`) shows its profiles: predicted vs measured seconds per term.
 */
import { Widget } from '@lumino/widgets';

import { currentAttempt, earlierAttempts, IAttemptCurve, withAttempts } from './attempts';
import { ISeriesSpec, LineChart, PALETTE } from './chart';
import { button, el } from './dom';
import { fmtBytes, fmtNumber, fmtPercent, fmtRate, fmtSeconds, fmtStep } from './format';
import { runStream, Stream } from './handler';
import { EXPERT_KEYS, expertHeatmap, ExpertLoadModel } from './expertLoad';
import { describePrediction, IPrediction, recentMedian, versus } from './prediction';
import { ProfileSection } from './profileSection';
import { RunModel } from './runModel';
import { Decimator, drawn, EmaCache, withSparse } from './series';
import { SettingsModel } from './settings';
import { Throttle } from './throttle';
import { RunMessage } from './types';

/** The metric columns a dashboard streams (the charts, KPIs and CSV export). */
export const DASHBOARD_KEYS = ['time', 'loss', 'grad_norm', 'lr', 'step_time', 'data_time',
  'ckpt_time', 'tokens_per_s', 'mfu', 'mfu_fp8', 'hfu', 'eval_loss', 'eval_perplexity', ...EXPERT_KEYS];

const pct = (v: number) => `${(v * 100).toFixed(v < 0.1 ? 1 : 0)}%`;

/** The dashed reference line of a prediction; its legend row hides without one. */
const PREDICTED = { dash: [6, 4], width: 1.5, className: 'jp-Workbench-predicted' };

export class RunDashboard extends Widget {
  readonly model: RunModel;
  private _stream: Stream<RunMessage>;
  private _throttle: Throttle;
  private _smoothing: number;
  private _head = el('div', 'jp-Workbench-dashHead');
  private _kpis = el('div', 'jp-Workbench-kpis');
  private _memory = el('div', 'jp-Workbench-memory');
  private _config = el('div', 'jp-Workbench-config');
  private _experts = new ExpertLoadModel();
  private _expertLayer = -1;
  private _expertBody = el('div', 'jp-Workbench-expertBody');
  private _expertSection = section('Expert load (tokens per expert / balanced)', this._expertBody);
  private _profiles: ProfileSection;
  private _smoothLabel = el('span', 'jp-Workbench-smoothLabel');
  private _charts: Record<'loss' | 'util' | 'time' | 'tput', LineChart>;
  private _attempts: IAttemptCurve[] = [];   // a restarted run's earlier attempts
  private _decimators = RunDashboard._newDecimators();
  private _ema = new EmaCache();

  constructor(id: string, private readonly _settings: SettingsModel) {
    super();
    this.addClass('jp-Workbench-dashboard');
    this.model = new RunModel(id);
    this.id = `workbench-run-${encodeURIComponent(id)}`;
    this.node.dataset.runId = id;
    this.title.label = id;
    this.title.closable = true;
    this._smoothing = _settings.value.smoothing;
    this._charts = {
      loss: lossChart([], 1),
      util: new LineChart({ title: 'Utilization', format: { y: pct }, series: [
        { label: 'MFU', stroke: PALETTE[2] }, { label: 'HFU', stroke: PALETTE[3], dash: [4, 3] },
        { label: 'predicted MFU', stroke: PALETTE[2], ...PREDICTED }] }),
      time: new LineChart({ title: 'Step time breakdown', format: { y: fmtSeconds }, series: [
        { label: 'total', stroke: PALETTE[4] }, { label: 'data', stroke: PALETTE[5] },
        { label: 'checkpoint', stroke: PALETTE[6] },
        { label: 'predicted', stroke: PALETTE[4], ...PREDICTED }] }),
      tput: new LineChart({ title: 'Throughput (tokens/s)', format: { y: fmtRate }, series: [
        { label: 'tokens/s', stroke: PALETTE[1] }] })
    };
    const slider = document.createElement('input');
    slider.type = 'range';
    slider.min = '0';
    slider.max = '0.99';
    slider.step = '0.01';
    slider.value = String(this._smoothing);
    slider.title = 'Loss smoothing (exponential moving average weight)';
    slider.addEventListener('input', () => {
      this._smoothing = Number(slider.value);
      this._throttle.schedule();
    });
    const tools = el('div', 'jp-Workbench-tools');
    tools.append(el('span', '', 'smoothing'), slider, this._smoothLabel,
      button('Export CSV', 'Download the metrics as CSV', () => this._exportCsv()));
    const grid = el('div', 'jp-Workbench-grid');
    grid.append(...Object.values(this._charts).map(c => c.node));
    const memSection = section('Memory per device', this._memory);
    const cfgSection = section('Config', this._config);
    this._expertSection.hidden = true;   // shown once a mixture-of-experts run logs loads
    this._profiles = new ProfileSection(id);   // shown once the run has a profile
    this.node.append(this._head, this._kpis, tools, grid, this._profiles.node,
      this._expertSection, memSection, cfgSection);
    this._throttle = new Throttle(() => this.render(), () => _settings.value.refreshRate);
    this.model.changed.connect((_, change) => {
      if (change === 'detail') {
        this._renderDetail();
      } else if (change === 'reset') {
        this._resetCaches();
      }
      this._throttle.schedule();
    });
    _settings.changed.connect(this._onSettings, this);
    this._stream = runStream(id, () => this.model.series.lastStep ?? -1,
      m => {
        this._experts.apply(m);
        this.model.apply(m);
      }, DASHBOARD_KEYS);
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._stream.dispose();
    this._throttle.dispose();
    this._profiles.dispose();
    Object.values(this._charts).forEach(c => c.dispose());
    this._settings.changed.disconnect(this._onSettings, this);
    super.dispose();
  }

  /** Redraws the charts and the KPI line from the model. */
  render(): void {
    const t0 = performance.now();
    const s = this.model.series;
    const max = this._settings.value.maxPoints;
    const step = s.column('step');
    const loss = s.column('loss');
    const smooth = this._ema.update(loss, this._smoothing);
    const dec = this._decimators;
    // the held-out loss is logged every eval_every steps: all its points are kept
    const evalLoss = s.column('eval_loss');
    const idx = withSparse(dec.loss.indices(step.length, [loss], max), evalLoss);
    const lossData = withAttempts(idx.map(i => step[i]),
      [loss, smooth, evalLoss].map(y => idx.map(i => drawn(y[i]))), this._attempts);
    this._charts.loss.setData(lossData.x, lossData.ys, t0);
    const pred = this.model.prediction;
    const util = dec.util.decimate(step, [s.column('mfu'), s.column('hfu')], max);
    this._charts.util.setData(util.x, [...util.ys, level(util.x, pred?.mfu ?? null)]);
    const time = dec.time.decimate(step, [s.column('step_time'), s.column('data_time'),
      s.column('ckpt_time')], max);
    this._charts.time.setData(time.x, [...time.ys, level(time.x, pred?.step_seconds ?? null)]);
    const tput = dec.tput.decimate(step, [s.column('tokens_per_s')], max);
    this._charts.tput.setData(tput.x, tput.ys);
    this._smoothLabel.textContent = this._smoothing.toFixed(2);
    const d = this.model.detail;
    const peak = (d?.peak_source ?? '') as string;
    // fp8 matmuls (GPTConfig.quantization): MFU against the bf16 peak and the fp8 peak
    const fp8 = s.last('mfu_fp8');
    const mfu = kpi('MFU', fmtPercent(s.last('mfu')) +
      (typeof fp8 === 'number' ? ` (fp8 peak ${fmtPercent(fp8)})` : ''),
      peak ? `peak FLOP/s from ${peak}` : undefined);
    const stepTime = kpi('step time', fmtSeconds(s.last('step_time')));
    addVersus(mfu, versus('mfu', recentMedian(s.column('mfu')), pred));
    addVersus(stepTime, versus('step_time', recentMedian(s.column('step_time')), pred));
    this._kpis.replaceChildren(
      kpi('step', fmtStep(s.lastStep ?? d?.step ?? 0, d?.target_steps)),
      kpi('loss', fmtNumber(s.last('loss'))),
      mfu,
      kpi('HFU', fmtPercent(s.last('hfu'))),
      kpi('tokens/s', fmtRate(s.last('tokens_per_s'))),
      stepTime,
      kpi('compile', fmtSeconds(this.model.compileSeconds)));
    this._markPrediction(pred);
    this._renderExperts();
  }

  /** The expert-load heatmap of a mixture-of-experts run (hidden for dense runs). */
  private _renderExperts(): void {
    this._expertSection.hidden = !this._experts.rows.length;
    if (this._experts.rows.length) {
      this._expertBody.replaceChildren(expertHeatmap(this._experts, this._expertLayer, l => {
        this._expertLayer = l;
        this._renderExperts();
      }));
    }
  }

  /** Says on the charts whether (and what) they show as predicted, for CSS and tests. */
  private _markPrediction(pred: IPrediction | null): void {
    const marks: ['util' | 'time', number | null][] = [
      ['util', pred?.mfu ?? null], ['time', pred?.step_seconds ?? null]];
    for (const [name, value] of marks) {
      const node = this._charts[name].node;
      node.classList.toggle('jp-mod-noPrediction', value === null);
      if (value === null) {
        delete node.dataset.predicted;
      } else {
        node.dataset.predicted = String(value);
      }
    }
  }

  private static _newDecimators(): Record<'loss' | 'util' | 'time' | 'tput', Decimator> {
    return { loss: new Decimator(), util: new Decimator(), time: new Decimator(),
      tput: new Decimator() };
  }

  /** The metrics file was replaced: cached decimation and smoothing no longer apply. */
  private _resetCaches(): void {
    this._decimators = RunDashboard._newDecimators();
    this._ema = new EmaCache();
  }

  private _onSettings(): void {
    this._throttle.schedule();
  }

  private _renderDetail(): void {
    const d = this.model.detail;
    if (!d) {
      return;
    }
    this.title.label = d.name || d.id;
    this.title.caption = `Workbench run ${d.id}`;
    const status = el('span', 'jp-Workbench-status', d.status);
    status.dataset.status = d.status;
    const pred = this.model.prediction;
    const facts = [
      `id ${d.id}`, d.config_hash ? `config ${d.config_hash}` : '',
      d.mesh && Object.keys(d.mesh).length ? `mesh ${Object.entries(d.mesh).map(([k, v]) => `${k}=${v}`).join(' × ')}` : '',
      d.device_kind ? `${d.device_kind}` : '', d.host ? `host ${d.host}` : '',
      pred ? `predicted by ${describePrediction(pred) || 'its plan'}` : ''
    ].filter(Boolean).join(' · ');
    this._head.replaceChildren(status, el('h2', 'jp-Workbench-runTitle', d.name || d.id),
      el('div', 'jp-Workbench-facts', facts));
    if (d.error) {
      this._head.append(el('pre', 'jp-Workbench-error', d.error));
    }
    if (typeof d.problem === 'string' && d.problem) {
      this._head.append(el('pre', 'jp-Workbench-error jp-Workbench-problem',
        `Not everything of this run could be read: ${d.problem}`));
    }
    this._renderAttempts(earlierAttempts(d['history']), currentAttempt(d['attempt']));
    this._memory.replaceChildren(memoryTable(d.memory_per_device ?? null));
    this._profiles.update(d.profiles);
    this._config.replaceChildren(tree(d.config ?? {}));
  }

  /** A restarted run: the loss chart gets one trace per earlier attempt (built again
   * when their number changes). */
  private _renderAttempts(earlier: IAttemptCurve[], attempt: number): void {
    const same = earlier.length === this._attempts.length
      && earlier.every((a, i) => a.attempt === this._attempts[i].attempt);
    this._attempts = earlier;
    if (same) {
      return;
    }
    const old = this._charts.loss;
    this._charts.loss = lossChart(earlier, attempt);
    old.node.replaceWith(this._charts.loss.node);
    old.dispose();
  }

  private _exportCsv(): void {
    const s = this.model.series;
    const keys = s.keys();
    const cols = keys.map(k => s.column(k));
    const lines = [keys.join(',')];
    for (let i = 0; i < s.length; i++) {
      lines.push(cols.map(c => (Number.isFinite(c[i]) ? String(c[i]) : '')).join(','));
    }
    const a = document.createElement('a');
    a.href = URL.createObjectURL(new Blob([lines.join('\n')], { type: 'text/csv' }));
    a.download = `${(this.model.name || 'run').replace(/[^\w.-]+/g, '_')}.csv`;
    a.click();
    URL.revokeObjectURL(a.href);
  }
}

/** Colours of earlier attempts' loss traces (thin, beside the current attempt's). */
const ATTEMPT_STROKES = ['#9c9c9c', '#b07aa1', '#76b7b2', '#edc948'];

/** The loss chart: the current attempt's loss, smoothed and held-out, and for a restarted
 * run one trace per earlier attempt ("attempt 1", ...; the current one is "attempt N"). */
function lossChart(earlier: IAttemptCurve[], attempt: number): LineChart {
  const traces: ISeriesSpec[] = earlier.map((a, i) => ({
    label: `attempt ${a.attempt}`, stroke: ATTEMPT_STROKES[i % ATTEMPT_STROKES.length], width: 1
  }));
  const chart = new LineChart({ title: 'Loss', series: [
    { label: earlier.length ? `attempt ${attempt}` : 'loss', stroke: '#9ecae1', width: 1 },
    { label: 'smoothed', stroke: PALETTE[0], width: 2 },
    { label: 'held-out (eval)', stroke: PALETTE[1], width: 2, dash: [5, 3] }, ...traces] });
  chart.node.classList.add('jp-Workbench-lossChart');
  chart.node.dataset.attempts = String(earlier.length + 1);
  return chart;
}

function section(title: string, body: HTMLElement): HTMLElement {
  const s = el('section', 'jp-Workbench-section');
  s.append(el('h3', '', title), body);
  return s;
}

/** A constant line at `value` over `x` (all gaps without a value). */
function level(x: number[], value: number | null): (number | null)[] {
  return x.map(() => value);
}

/** Adds a prediction line ('pred. 10 ms · measured 1.23×') under a KPI card's value. */
function addVersus(card: HTMLElement, v: { text: string; title: string } | null): void {
  if (!v) {
    return;
  }
  card.append(el('span', 'jp-Workbench-kpiPred', v.text));
  card.classList.add('jp-mod-predicted');
  card.title = card.title ? `${card.title}\n${v.title}` : v.title;
}

function kpi(label: string, value: string, title?: string): HTMLElement {
  const k = el('div', 'jp-Workbench-kpi');
  k.append(el('span', 'jp-Workbench-kpiLabel', label), el('span', 'jp-Workbench-kpiValue', value));
  if (title) {
    k.title = title;
  }
  return k;
}

/**
 * Memory per device as a table: `{buffer: bytes}` (argument/output/temp, the same on
 * every device) gives one row per buffer and a total; `{device: {buffer: bytes}}` gives
 * one row per device. Values are text.
 */
export function memoryTable(mem: Record<string, unknown> | null): HTMLElement {
  if (!mem || !Object.keys(mem).length) {
    return el('div', 'jp-Workbench-empty', 'No memory figures recorded for this run.');
  }
  const rows = Object.entries(mem);
  const nested = rows.some(([, v]) => v !== null && typeof v === 'object');
  const cols = nested
    ? [...new Set(rows.flatMap(([, v]) => Object.keys((v ?? {}) as object)))]
    : ['bytes per device'];
  const table = el('table', 'jp-Workbench-table');
  const head = el('tr', '');
  head.append(el('th', '', nested ? 'device' : 'buffer'), ...cols.map(c => el('th', '', c)));
  table.append(head);
  const num = (v: unknown) => (typeof v === 'number' ? v : 0);
  const first = (v: unknown) => (nested ? num((v as Record<string, unknown>)?.[cols[0]]) : num(v));
  const peak = Math.max(1, ...rows.map(([, v]) => first(v)));
  const body = nested ? rows : [...rows, ['total', rows.reduce((n, [, v]) => n + num(v), 0)] as const];
  for (const [name, v] of body) {
    const tr = el('tr', '');
    tr.append(el('td', '', name));
    for (const c of cols) {
      const x = nested ? ((v ?? {}) as Record<string, unknown>)[c] : v;
      const td = el('td', 'jp-Workbench-num', typeof x === 'number' ? fmtBytes(x) : String(x ?? '–'));
      if (c === cols[0] && typeof x === 'number' && name !== 'total') {
        td.style.setProperty('--wb-bar', `${Math.min(100, (100 * x) / peak)}%`);
        td.classList.add('jp-Workbench-bar');
      }
      tr.append(td);
    }
    table.append(tr);
  }
  return table;
}

/** A JSON value as a collapsible tree; every key and value is text. */
export function tree(value: unknown, key?: string): HTMLElement {
  if (value !== null && typeof value === 'object') {
    const d = el('details', 'jp-Workbench-tree');
    d.open = true;
    d.append(el('summary', '', key ?? (Array.isArray(value) ? '[…]' : '{…}')));
    for (const [k, v] of Object.entries(value as Record<string, unknown>)) {
      d.append(tree(v, k));
    }
    return d;
  }
  const line = el('div', 'jp-Workbench-leaf');
  line.append(el('span', 'jp-Workbench-key', `${key ?? ''}: `),
    el('span', 'jp-Workbench-value', JSON.stringify(value) ?? String(value)));
  return line;
}
