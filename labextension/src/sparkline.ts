/** A loss sparkline on a small canvas (the side panel's per-run trend). */

/**
 * Draws `ys` scaled into the canvas, the line broken at each null (a NaN loss: a gap);
 * sets `data-points` on the canvas to the number of points drawn and `data-gaps` to
 * the number of nulls.
 */
export function drawSparkline(
  canvas: HTMLCanvasElement,
  ys: ReadonlyArray<number | null>,
  color = '#1f77b4'
): void {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 96;
  const h = canvas.clientHeight || 24;
  canvas.width = Math.round(w * dpr);
  canvas.height = Math.round(h * dpr);
  const ctx = canvas.getContext('2d');
  const pts = ys.map((y, i) => [i, y] as const).filter((p): p is readonly [number, number] =>
    p[1] !== null && Number.isFinite(p[1]));
  canvas.dataset.points = String(pts.length);
  canvas.dataset.gaps = String(ys.length - pts.length);
  if (!ctx || pts.length < 2) {
    ctx?.clearRect(0, 0, canvas.width, canvas.height);
    return;
  }
  const lo = Math.min(...pts.map(p => p[1]));
  const hi = Math.max(...pts.map(p => p[1]));
  const n = ys.length - 1;
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = color;
  ctx.lineWidth = 1.25;
  ctx.beginPath();
  pts.forEach(([i, y], k) => {
    const px = (i / n) * (w - 2) + 1;
    const py = hi === lo ? h / 2 : h - 2 - ((y - lo) / (hi - lo)) * (h - 4);
    if (k === 0 || pts[k - 1][0] !== i - 1) {
      ctx.moveTo(px, py); // the first point, or the first after a gap
    } else {
      ctx.lineTo(px, py);
    }
  });
  ctx.stroke();
}
