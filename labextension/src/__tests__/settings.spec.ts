import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { Signal } from '@lumino/signaling';

import { DEFAULT_SETTINGS, SettingsModel } from '../settings';

import schema from '../../schema/plugin.json';

/** The part of ISettings that SettingsModel reads: `composite` and `changed`. */
class FakeSettings {
  composite: Record<string, unknown> = {};
  readonly changed = new Signal<this, void>(this);
}

describe('SettingsModel', () => {
  it('starts from the schema defaults and follows the registry', () => {
    expect(DEFAULT_SETTINGS).toEqual({
      refreshRate: schema.properties.refreshRate.default,
      smoothing: schema.properties.smoothing.default,
      maxPoints: schema.properties.maxPoints.default
    });
    const model = new SettingsModel();
    const fake = new FakeSettings();
    const seen: number[] = [];
    model.changed.connect((_, v) => seen.push(v.maxPoints));
    model.connect(fake as unknown as ISettingRegistry.ISettings);
    expect(model.value).toEqual(DEFAULT_SETTINGS);
    fake.composite = { refreshRate: 100, smoothing: 0.9, maxPoints: 500 };
    fake.changed.emit();
    expect(model.value).toEqual({ refreshRate: 100, smoothing: 0.9, maxPoints: 500 });
    expect(seen).toEqual([DEFAULT_SETTINGS.maxPoints, 500]);
  });
});
