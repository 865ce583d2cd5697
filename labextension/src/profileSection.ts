/**
 * The dashboard's "Profiles" section: fetches a run's profiles when the list in its
 * run detail changes (a report written beside a trace) and shows one of them (the latest
 * by default, with a picker when there are several). Hidden while the run has none.
 */
import { el } from './dom';
import { fetchProfiles } from './handler';
import { IProfile, parseProfiles, profileView } from './profile';

export class ProfileSection {
  readonly node = el('section', 'jp-Workbench-section');
  private _body = el('div', 'jp-Workbench-profiles');
  private _profiles: IProfile[] = [];
  private _shown = '';
  private _stamp = '';
  private _disposed = false;

  constructor(private readonly _runId: string) {
    this.node.append(el('h3', '', 'Profiles: predicted vs measured, term by term'), this._body);
    this.node.hidden = true;
  }

  dispose(): void {
    this._disposed = true;
  }

  /** Run detail's `profiles` (`[{name, step, updated}]`): fetches when it changed. */
  update(listed: unknown): void {
    const stamp = JSON.stringify(listed ?? []);
    if (stamp === this._stamp) {
      return;
    }
    this._stamp = stamp;
    if (!Array.isArray(listed) || !listed.length) {
      this._profiles = [];
      this._render();
      return;
    }
    fetchProfiles(this._runId).then(answer => {
      if (!this._disposed && stamp === this._stamp) {
        this._profiles = parseProfiles(answer);
        this._shown = this._profiles[this._profiles.length - 1]?.name ?? '';
        this._render();
      }
    }).catch(err => {
      this.node.hidden = false;
      this._body.replaceChildren(el('pre', 'jp-Workbench-error',
        `The run's profiles could not be read: ${String(err)}`));
    });
  }

  private _render(): void {
    const all = this._profiles;
    this.node.hidden = !all.length;
    const shown = all.find(p => p.name === this._shown) ?? all[all.length - 1];
    if (!shown) {
      this._body.replaceChildren();
      return;
    }
    const parts: HTMLElement[] = [];
    if (all.length > 1) {
      const pick = el('select', 'jp-Workbench-profilePick');
      pick.title = 'Which profile to show (profiles/<step>/ of the run directory)';
      for (const p of all) {
        const o = el('option', '', `step ${p.step ?? p.name}`);
        o.value = p.name;
        o.selected = p === shown;
        pick.append(o);
      }
      pick.addEventListener('change', () => {
        this._shown = pick.value;
        this._render();
      });
      parts.push(pick);
    }
    parts.push(profileView(shown));
    this._body.replaceChildren(...parts);
  }
}
