/**
 * Workbench for JupyterLab: the runs side panel, run dashboards, run comparison and a
 * status bar item, all fed by the Workbench server extension's streams.
 */
import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette, MainAreaWidget, WidgetTracker } from '@jupyterlab/apputils';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { lineFormIcon } from '@jupyterlab/ui-components';

import { CompareRuns } from './compare';
import { RunDashboard } from './dashboard';
import { fetchRunsPage, listStream } from './handler';
import { RunsPanel } from './panel';
import { RunsModel } from './runsModel';
import { SettingsModel } from './settings';
import { RunStatus } from './statusbar';
import { CommandIDs, IWorkbench } from './tokens';

export { CommandIDs, IWorkbench } from './tokens';

const PLUGIN_ID = 'workbench-lab:plugin';

type Dashboard = MainAreaWidget<RunDashboard>;
type Comparison = MainAreaWidget<CompareRuns>;

/** Side panel, commands, dashboards, comparisons and layout restoration. */
const runsPlugin: JupyterFrontEndPlugin<IWorkbench> = {
  id: PLUGIN_ID,
  description: 'Workbench runs panel and live run dashboards.',
  autoStart: true,
  provides: IWorkbench,
  optional: [ILayoutRestorer, ISettingRegistry, ICommandPalette, ILabShell],
  activate: (
    app: JupyterFrontEnd,
    restorer: ILayoutRestorer | null,
    registry: ISettingRegistry | null,
    palette: ICommandPalette | null,
    labShell: ILabShell | null
  ): IWorkbench => {
    const runs = new RunsModel();
    const settings = new SettingsModel();
    if (registry) {
      registry.load(PLUGIN_ID).then(s => settings.connect(s)).catch(reason =>
        console.warn(`Workbench: settings of ${PLUGIN_ID} not loaded (${reason}); using defaults`));
    }
    const stream = listStream(m => runs.apply(m), up => (runs.connected = up));
    const dashboards = new WidgetTracker<Dashboard>({ namespace: 'workbench-run' });
    const comparisons = new WidgetTracker<Comparison>({ namespace: 'workbench-compare' });
    const { commands, shell } = app;

    const panel = new RunsPanel({
      model: runs,
      settings,
      openRun: id => void commands.execute(CommandIDs.openRun, { id }),
      compare: ids => void commands.execute(CommandIDs.compareRuns, { ids }),
      refresh: () => stream.reconnect(),
      loadMore: async () => {
        const next = runs.next;
        if (next !== null) {
          runs.addPage(await fetchRunsPage(next));
        }
      }
    });
    panel.title.icon = lineFormIcon;
    shell.add(panel, 'left', { rank: 700 });

    commands.addCommand(CommandIDs.openRuns, {
      label: 'Workbench: Show Runs',
      caption: 'Show the Workbench runs side panel',
      execute: () => shell.activateById(panel.id)
    });
    commands.addCommand(CommandIDs.openRun, {
      label: args => (args['id'] ? `Workbench run ${String(args['id'])}` : 'Workbench: Open Run'),
      caption: 'Open a run dashboard: loss, MFU/HFU, step time, tokens/s, memory, config',
      execute: args => {
        const id = String(args['id'] ?? runs.latestRunning()?.id ?? runs.runs[0]?.id ?? '');
        if (!id) {
          return null;
        }
        const open = dashboards.find(w => w.content.model.id === id);
        if (open) {
          shell.activateById(open.id);
          return open;
        }
        const widget = new MainAreaWidget({ content: new RunDashboard(id, settings) });
        widget.id = widget.content.id;
        widget.content.title.icon = lineFormIcon;
        void dashboards.add(widget);
        shell.add(widget, 'main');
        shell.activateById(widget.id);
        return widget;
      }
    });
    commands.addCommand(CommandIDs.compareRuns, {
      label: 'Workbench: Compare Runs',
      caption: 'Show several runs on one chart (the runs checked in the panel)',
      execute: args => {
        const given = args['ids'] as string[] | undefined;
        const ids = given?.length ? given : panel.selected();
        if (!ids.length) {
          return null;
        }
        const widget = new MainAreaWidget({ content: new CompareRuns(ids, settings) });
        widget.id = widget.content.id;
        widget.content.title.icon = lineFormIcon;
        const prior = comparisons.find(w => w.id === widget.id);
        if (prior) {
          widget.dispose();
          shell.activateById(prior.id);
          return prior;
        }
        void comparisons.add(widget);
        shell.add(widget, 'main');
        shell.activateById(widget.id);
        return widget;
      }
    });
    palette?.addItem({ command: CommandIDs.openRuns, category: 'Workbench' });
    palette?.addItem({ command: CommandIDs.compareRuns, category: 'Workbench' });

    if (restorer) {
      restorer.add(panel, 'workbench-runs');
      void restorer.restore(dashboards, {
        command: CommandIDs.openRun,
        args: w => ({ id: w.content.model.id }),
        name: w => w.content.model.id
      });
      void restorer.restore(comparisons, {
        command: CommandIDs.compareRuns,
        args: w => ({ ids: w.content.ids }),
        name: w => w.content.ids.join('\n')
      });
    }
    let active: string | null = null;
    labShell?.currentChanged.connect((_, change) => {
      const w = change.newValue;
      if (w && dashboards.has(w)) {
        active = (w as Dashboard).content.model.id;
        runs.touch();
      }
    });
    dashboards.widgetAdded.connect((_, w) => {
      w.disposed.connect(() => {
        if (active === w.content.model.id) {
          active = null;
        }
      });
    });
    return { runs, settings, activeRunId: () => active };
  }
};

/** The status bar item: the active run's step and MFU. */
const statusPlugin: JupyterFrontEndPlugin<void> = {
  id: 'workbench-lab:status',
  description: 'Shows the active Workbench run in the status bar.',
  autoStart: true,
  requires: [IWorkbench, IStatusBar],
  activate: (app: JupyterFrontEnd, wb: IWorkbench, statusBar: IStatusBar) => {
    const item = new RunStatus(wb, id => void app.commands.execute(CommandIDs.openRun, { id }));
    statusBar.registerStatusItem('workbench-lab:status', {
      item,
      align: 'left',
      rank: 5,
      isActive: () => true
    });
  }
};

export default [runsPlugin, statusPlugin];
