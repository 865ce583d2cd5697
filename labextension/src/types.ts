/** Shapes of the Workbench server API (workbench/server/handlers.py), shared by all views. */

/** What every run record carries: its URL id, `run.json` id, name, status and progress. */
export interface RunBase {
  id: string;
  uid: string | null;
  name: string;
  status: string;
  step: number;
  target_steps: number | null;
}

/** One run in the runs list (`GET /workbench/api/runs`, list stream updates). */
export interface RunSummary extends RunBase {
  created: number | null;
  updated: number;
  config_hash: string | null;
  device_kind: string | null;
  peak_source: string | null;
  points: number;
  loss: number | null;
  mfu: number | null;
  /** MFU against the fp8 peak, for a model with fp8 matmuls (`mfu` is the bf16 peak's). */
  mfu_fp8?: number | null;
  hfu: number | null;
  tokens_per_s: number | null;
  step_time: number | null;
  /** Sampled loss for the sparkline; null: a NaN/Infinity loss, drawn as a gap. */
  spark: { step: number[]; loss: (number | null)[] };
  /** What of the run could not be read (an unreadable run.json: status 'error';
   * skipped metrics lines; run.json fields of the wrong type), or null. */
  problem?: string | null;
  /** The plan's prediction (step_seconds, mfu, bound, source), if the run has one;
   * check it with `parsePrediction` before use. */
  prediction?: unknown;
}

/** A run's `run.json` plus its URL id (`GET /workbench/api/runs/<id>`). */
export interface RunDetail extends RunBase {
  config: Record<string, unknown>;
  config_hash?: string;
  mesh?: Record<string, number>;
  devices?: unknown[];
  device_kind?: string | null;
  peak_flops?: number | null;
  peak_source?: string | null;
  model_flops_per_step?: number | null;
  memory_per_device?: Record<string, unknown> | null;
  error?: string | null;
  host?: string;
  /** The plan's prediction (`Trainer.from_plan`); check it with `parsePrediction`. */
  prediction?: unknown;
  events?: { event: string; [key: string]: unknown }[];
  /** What of the run could not be read (see `RunSummary.problem`), or null. */
  problem?: string | null;
  [key: string]: unknown;
}

/** Columnar metrics (`GET .../metrics` and run stream `metrics` messages). */
export interface MetricsPage {
  id: string;
  count: number;
  last_step: number | null;
  columns: Record<string, unknown[]>;
  /** Per column, the rows whose value was null, NaN or ±Infinity in the file (sent as
   * null): drawn as gaps, while missing values (also null) are joined across. */
  gaps?: Record<string, number[]>;
  more?: boolean;
}

/** One page of the runs list (`GET /workbench/api/runs?cursor=...`), newest created first:
 * `total` runs in all, `next` the cursor of the page after (null on the last). */
export interface RunsPage {
  runs: RunSummary[];
  total: number;
  next: string | null;
}

/** Messages of the list stream (`/workbench/api/stream`); `runs` is the first page. */
export type ListMessage =
  | ({ type: 'runs' } & RunsPage)
  | { type: 'update'; runs: RunSummary[] }
  | { type: 'removed'; ids: string[] };

/** Messages of a run stream (`/workbench/api/runs/<id>/stream`). */
export type RunMessage =
  | { type: 'run'; run: RunDetail }
  | ({ type: 'metrics' } & MetricsPage)
  | { type: 'reset' };
