/** The status bar item: the active run's name, step and MFU. */
import { Widget } from '@lumino/widgets';

import { fmtPercent, fmtStep } from './format';
import { Throttle } from './throttle';
import { IWorkbench } from './tokens';

export class RunStatus extends Widget {
  private _throttle: Throttle;

  constructor(private readonly _wb: IWorkbench, onClick: (id: string) => void) {
    super();
    this.addClass('jp-Workbench-statusItem');
    this._throttle = new Throttle(() => this.render(), () => _wb.settings.value.refreshRate);
    _wb.runs.changed.connect(() => this._throttle.schedule());
    this.node.addEventListener('click', () => {
      const id = this.node.dataset.runId;
      if (id) {
        onClick(id);
      }
    });
    this.render();
  }

  /**
   * Shows the run of the current dashboard, else the latest running run, else the most
   * recently updated one; hidden when there are no runs.
   */
  render(): void {
    const active = this._wb.activeRunId();
    const runs = this._wb.runs;
    const run = (active && runs.get(active)) || runs.latestRunning() || runs.runs[0];
    this.node.dataset.runId = run?.id ?? '';
    this.node.textContent = run
      ? `${run.name} · ${fmtStep(run.step, run.target_steps)} · MFU ${fmtPercent(run.mfu)}`
      : '';
    this.node.title = run ? `Workbench run ${run.id} (${run.status}); click to open` : '';
    this.setHidden(!run);
  }

  dispose(): void {
    this._throttle.dispose();
    super.dispose();
  }
}
