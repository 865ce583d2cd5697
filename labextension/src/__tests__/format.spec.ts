import { fmtBytes, fmtNumber, fmtPercent, fmtRate, fmtSeconds, fmtStep } from '../format';

describe('format', () => {
  it('formats numbers, percentages, bytes, durations and rates', () => {
    expect(fmtNumber(2.345678)).toBe('2.346');
    expect(fmtNumber(null)).toBe('–');
    expect(fmtNumber(1234567)).toBe('1.235e+6');
    expect(fmtPercent(0.3127)).toBe('31.3%');
    expect(fmtBytes(1536)).toBe('1.5 KiB');
    expect(fmtBytes(3 * 1024 ** 3)).toBe('3.0 GiB');
    expect(fmtSeconds(0.0123)).toBe('12.3 ms');
    expect(fmtSeconds(0.05)).toBe('50 ms');
    expect(fmtSeconds(0)).toBe('0 s');
    expect(fmtSeconds(1.25)).toBe('1.25 s');
    expect(fmtSeconds(123)).toBe('2m 03s');
    expect(fmtRate(12345)).toBe('12.3k');
    expect(fmtStep(120, 200)).toBe('step 120 / 200');
    expect(fmtStep(5, null)).toBe('step 5');
  });
});
