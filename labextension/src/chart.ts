/** A streaming line chart: uPlot on a canvas, sized to its box, with draw bookkeeping. */
import uPlot from 'uplot';

/** One line of a chart. */
export interface ISeriesSpec {
  label: string;
  stroke: string;
  width?: number;
  dash?: number[];
  /** Scale key; series with another scale get a right-hand axis. */
  scale?: string;
  /** A class on the series' legend row (e.g. to hide a reference line's entry). */
  className?: string;
}

export interface IChartOptions {
  title: string;
  series: ISeriesSpec[];
  /** Formats y tick values (per scale). */
  format?: Record<string, (v: number) => string>;
  height?: number;
}

export const PALETTE = ['#1f77b4', '#d62728', '#2ca02c', '#ff7f0e', '#9467bd', '#8c564b',
  '#e377c2', '#17becf', '#bcbd22', '#7f7f7f'];

/**
 * The chart element carries `data-points` (points drawn in the first series),
 * `data-gaps` (its gaps: nulls, where the line breaks),
 * `data-last-step`, `data-drawn-at` (epoch ms of the last draw) and `data-draw-ms`
 * (from preparing the data to drawn), for tests and benchmarks.
 */
export class LineChart {
  readonly node: HTMLDivElement;
  private _plot: uPlot | null = null;
  private _data: uPlot.AlignedData = [[]];
  private _observer: ResizeObserver;
  private _t0 = 0;

  constructor(private readonly _opts: IChartOptions) {
    this.node = document.createElement('div');
    this.node.className = 'jp-Workbench-chart';
    this.node.dataset.points = '0';
    this._data = [[], ..._opts.series.map(() => [])];
    this._observer = new ResizeObserver(() => this._resize());
    this._observer.observe(this.node);
  }

  /**
   * Replaces the data: x values and one array per series (null: a gap, the line breaks;
   * undefined: missing, the line joins across). `startedAt`
   * (a `performance.now()` time) is when the caller began preparing it, so `data-draw-ms`
   * covers decimation too.
   */
  setData(x: number[], ys: (number | null | undefined)[][],
    startedAt = performance.now()): void {
    this._t0 = startedAt;
    this._data = [x, ...ys] as uPlot.AlignedData;
    if (this._plot) {
      this._plot.setData(this._data);
    } else {
      this._resize();
    }
  }

  /** uPlot's draw hook: the data is on the canvas now. */
  private _drawn(): void {
    const x = this._data[0];
    const first = (this._data[1] ?? []) as (number | null | undefined)[];
    this.node.dataset.points = String(first.filter(v => v !== null && v !== undefined).length);
    this.node.dataset.gaps = String(first.filter(v => v === null).length);
    this.node.dataset.lastStep = x.length ? String(x[x.length - 1]) : '';
    this.node.dataset.drawnAt = String(Date.now());
    this.node.dataset.drawMs = (performance.now() - this._t0).toFixed(2);
  }

  dispose(): void {
    this._observer.disconnect();
    this._plot?.destroy();
    this._plot = null;
  }

  private _resize(): void {
    const width = Math.floor(this.node.clientWidth);
    if (width < 50) {
      return; // hidden or not attached yet
    }
    const height = this._opts.height ?? 220;
    if (!this._plot) {
      this._plot = new uPlot(this._options(width, height), this._data, this.node);
    } else if (Math.abs(this._plot.width - width) > 1) {
      this._plot.setSize({ width, height });
    }
  }

  private _options(width: number, height: number): uPlot.Options {
    const scales = [...new Set(this._opts.series.map(s => s.scale ?? 'y'))];
    const fmt = this._opts.format ?? {};
    const axes: uPlot.Axis[] = [{ label: 'step' }];
    scales.forEach((scale, i) => {
      const f = fmt[scale];
      axes.push({
        scale,
        side: i === 0 ? 3 : 1,
        grid: { show: i === 0 },
        size: 72,
        values: f ? (_u: uPlot, vals: number[]) => vals.map(v => (v === null ? '' : f(v))) : undefined
      });
    });
    return {
      title: this._opts.title,
      width,
      height,
      scales: { x: { time: false } },
      axes,
      legend: { live: true },
      hooks: { draw: [() => this._drawn()] },
      cursor: { drag: { x: true, y: false } },
      series: [
        { label: 'step' },
        ...this._opts.series.map(s => ({
          label: s.label,
          stroke: s.stroke,
          width: s.width ?? 1.5,
          dash: s.dash,
          class: s.className,
          scale: s.scale ?? 'y',
          spanGaps: false, // null breaks the line; undefined (missing) is joined across
          points: { show: false },
          value: (_u: uPlot, v: number | null) =>
            v === null ? '–' : (fmt[s.scale ?? 'y'] ?? String)(v)
        }))
      ]
    };
  }
}
