/** The user settings of the extension (schema/plugin.json) as a typed, observable object. */
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { ISignal, Signal } from '@lumino/signaling';

export interface IWorkbenchSettings {
  /** At most one redraw per this many milliseconds. */
  refreshRate: number;
  /** Loss EMA weight in [0, 0.999]. */
  smoothing: number;
  /** Points drawn per series before min-max decimation kicks in. */
  maxPoints: number;
}

export const DEFAULT_SETTINGS: IWorkbenchSettings = {
  refreshRate: 250,
  smoothing: 0.6,
  maxPoints: 4000
};

/** Current settings; follows the setting registry when one is connected. */
export class SettingsModel {
  private _value: IWorkbenchSettings = { ...DEFAULT_SETTINGS };
  private _changed = new Signal<this, IWorkbenchSettings>(this);

  get value(): IWorkbenchSettings {
    return this._value;
  }

  get changed(): ISignal<this, IWorkbenchSettings> {
    return this._changed;
  }

  /** Follows a loaded settings object from the registry. */
  connect(settings: ISettingRegistry.ISettings): void {
    const load = () => {
      const c = settings.composite as Partial<IWorkbenchSettings>;
      this._value = {
        refreshRate: c.refreshRate ?? DEFAULT_SETTINGS.refreshRate,
        smoothing: c.smoothing ?? DEFAULT_SETTINGS.smoothing,
        maxPoints: c.maxPoints ?? DEFAULT_SETTINGS.maxPoints
      };
      this._changed.emit(this._value);
    };
    load();
    settings.changed.connect(load);
  }
}
