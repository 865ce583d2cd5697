/** Command ids and the token through which other plugins reach the runs model. */
import { Token } from '@lumino/coreutils';

import { RunsModel } from './runsModel';
import { SettingsModel } from './settings';

export namespace CommandIDs {
  /** Shows the Workbench runs side panel. */
  export const openRuns = 'workbench:open-runs';
  /** Opens a run's dashboard in the main area (args: `{id}`). */
  export const openRun = 'workbench:open-run';
  /** Opens one chart comparing runs (args: `{ids: string[]}`; default: the selected runs). */
  export const compareRuns = 'workbench:compare-runs';
}

/** What the main plugin shares: the live runs list, settings and the active run id. */
export interface IWorkbench {
  readonly runs: RunsModel;
  readonly settings: SettingsModel;
  /** The run of the current dashboard, else null (status bar follows the latest run). */
  activeRunId(): string | null;
}

export const IWorkbench = new Token<IWorkbench>(
  'workbench-lab:IWorkbench',
  'The Workbench runs list, settings and active run.'
);
