// A small canvas line chart: several series over one x axis (the step), optional log2 y
// axis, and marks at chosen x positions (overflow steps). A series is either aligned with the
// chart's x values, or sparse, with x values of its own (evaluations every so many steps):
// drawn as dots joined by a line. Drawing is explicit (draw()), so the page decides when: at
// most once per animation frame, and only when data changed.

const PAD = { left: 56, right: 6, top: 6, bottom: 16 };

export class LineChart {
  /**
   * @param {HTMLCanvasElement} canvas
   * @param {{series: {name: string, colour: string}[], log2?: boolean, format: (v: number) => string}} options
   */
  constructor(canvas, options) {
    this.canvas = canvas;
    this.options = options;
    this.xs = [];
    this.ys = options.series.map(() => []);
    this.marks = [];
  }

  /** Point the chart at its data (arrays are read, not copied, at each draw): `ys[i]` is an
   * array aligned with `xs`, or `{xs, ys}` for a sparse series (x ascending). */
  setData(xs, ys, marks) {
    this.xs = xs;
    this.ys = ys;
    this.marks = marks;
  }

  draw() {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = Math.max(1, Math.round(canvas.clientWidth * ratio));
    const height = Math.max(1, Math.round(canvas.clientHeight * ratio));
    if (canvas.width !== width || canvas.height !== height) {
      canvas.width = width;
      canvas.height = height;
    }
    const count = (ys) => ys.filter((y) => y !== null).length;
    const aligned = this.ys.filter((ys) => Array.isArray(ys));
    const sparse = this.ys.filter((ys) => !Array.isArray(ys));
    // data-values: values of the aligned series; data-sparse-values: of the sparse ones.
    canvas.dataset.points = String(this.xs.length);
    canvas.dataset.values = String(aligned.reduce((n, ys) => n + count(ys), 0));
    canvas.dataset.sparseValues = String(sparse.reduce((n, s) => n + count(s.ys), 0));
    canvas.dataset.marks = String(this.marks.length);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    const w = width / ratio;
    const h = height / ratio;
    ctx.clearRect(0, 0, w, h);
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillStyle = "#6b6b70";
    let x0 = this.xs.length ? this.xs[0] : Infinity;
    let x1 = this.xs.length ? this.xs[this.xs.length - 1] : -Infinity;
    for (const series of sparse) {
      if (series.xs.length === 0) continue;
      x0 = Math.min(x0, series.xs[0]);
      x1 = Math.max(x1, series.xs[series.xs.length - 1]);
    }
    if (!Number.isFinite(x0)) {
      ctx.fillText("no data yet", PAD.left, h / 2);
      return;
    }
    const log2 = Boolean(this.options.log2);
    const transform = (v) => (log2 ? Math.log2(Math.max(v, Number.MIN_VALUE)) : v);
    let lo = Infinity;
    let hi = -Infinity;
    for (const ys of this.ys) {
      for (const y of Array.isArray(ys) ? ys : ys.ys) {
        if (y === null || (log2 && y <= 0)) continue;
        const t = transform(y);
        if (t < lo) lo = t;
        if (t > hi) hi = t;
      }
    }
    if (!Number.isFinite(lo)) {
      lo = 0;
      hi = 1;
    }
    const fmt = this.options.format;
    const label = (t) => fmt(log2 ? 2 ** t : t);
    if (label(lo) === label(hi)) [lo, hi] = flatAxis(lo, hi, label, log2);
    canvas.dataset.axis = JSON.stringify([label(lo), label(hi)]);
    const span = Math.max(x1 - x0, 1);
    const plotW = w - PAD.left - PAD.right;
    const plotH = h - PAD.top - PAD.bottom;
    const px = (x) => PAD.left + ((x - x0) / span) * plotW;
    const py = (t) => PAD.top + (1 - (t - lo) / (hi - lo)) * plotH;

    // Axes: y range and x range as text, no gridlines (the shape matters here, not ticks).
    ctx.textAlign = "right";
    ctx.fillText(label(hi), PAD.left - 4, PAD.top + 8);
    ctx.fillText(label(lo), PAD.left - 4, PAD.top + plotH);
    ctx.textAlign = "left";
    ctx.fillText(String(x0), PAD.left, h - 3);
    ctx.textAlign = "right";
    ctx.fillText(String(x1), w - PAD.right, h - 3);

    ctx.strokeStyle = "rgba(214, 47, 47, 0.55)";
    ctx.lineWidth = 1;
    for (const x of this.marks) {
      const X = Math.round(px(x)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(X, PAD.top);
      ctx.lineTo(X, PAD.top + plotH);
      ctx.stroke();
    }

    // Lines: several points falling in one pixel column collapse to their min..max segment,
    // so a long run costs one pass over its data and at most a few strokes per pixel.
    this.options.series.forEach((series, i) => {
      const ys = this.ys[i];
      if (!Array.isArray(ys)) {
        this.drawSparse(ctx, series.colour, ys, px, (y) => py(transform(y)), log2);
        return;
      }
      ctx.strokeStyle = series.colour;
      ctx.lineWidth = 1.4;
      ctx.beginPath();
      let pen = false;
      let column = -1;
      let cmin = 0;
      let cmax = 0;
      const flush = () => {
        if (column < 0) return;
        const a = py(cmin);
        const b = py(cmax);
        if (pen) ctx.lineTo(column, a);
        else ctx.moveTo(column, a);
        if (b !== a) ctx.lineTo(column, b);
        pen = true;
      };
      for (let k = 0; k < ys.length; k++) {
        const y = ys[k];
        if (y === null || (log2 && y <= 0)) {
          flush();
          column = -1;
          pen = false;
          continue;
        }
        const t = transform(y);
        const X = Math.round(px(this.xs[k]));
        if (X !== column) {
          flush();
          column = X;
          cmin = t;
          cmax = t;
        } else {
          if (t < cmin) cmin = t;
          if (t > cmax) cmax = t;
        }
      }
      flush();
      ctx.stroke();
      if (ys.length === 1 && ys[0] !== null) {
        ctx.fillStyle = series.colour;
        ctx.fillRect(px(this.xs[0]) - 1.5, py(transform(ys[0])) - 1.5, 3, 3);
      }
    });
  }

  /** A sparse series: a line through its points, and a dot at each. */
  drawSparse(ctx, colour, series, px, py, log2) {
    const points = [];
    series.xs.forEach((x, k) => {
      const y = series.ys[k];
      if (y !== null && !(log2 && y <= 0)) points.push([px(x), py(y)]);
    });
    ctx.strokeStyle = colour;
    ctx.fillStyle = colour;
    ctx.lineWidth = 1.4;
    ctx.beginPath();
    points.forEach(([X, Y], k) => (k ? ctx.lineTo(X, Y) : ctx.moveTo(X, Y)));
    ctx.stroke();
    for (const [X, Y] of points) {
      ctx.beginPath();
      ctx.arc(X, Y, 2.5, 0, 2 * Math.PI);
      ctx.fill();
    }
  }
}

/** [Note: a flat axis] The y range of a series whose spread its labels cannot show: a flat
 * series, or one that varies only in digits the labels do not print (a memory figure a few
 * bytes apart). Stretched over the full height, such a series looked like separate lines
 * jumping between two identical labels; it is drawn flat, mid-height, between labels that
 * differ (5% either side, or as far as the labels need), and one flat at zero (a pool never
 * used) along the bottom. `lo`, `hi` and `label` are in the axis's own (log2) scale. */
function flatAxis(lo, hi, label, log2) {
  const mid = (lo + hi) / 2;
  if (!log2 && Math.abs(mid) < 1e-300) return [0, 1];
  let pad = log2 ? 1 : Math.abs(mid) * 0.05;
  for (let i = 0; i < 64 && label(mid - pad) === label(mid + pad); i++) pad *= 2;
  return [mid - pad, mid + pad];
}

export function formatBytes(v) {
  if (Math.abs(v) < 1) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let x = Math.abs(v);
  while (x >= 1024 && i < units.length - 1) {
    x /= 1024;
    i++;
  }
  return `${(Math.sign(v) * x).toFixed(x >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
}

export function formatNumber(v) {
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(1);
  return a >= 100 ? v.toFixed(0) : a >= 1 ? v.toFixed(2) : v.toFixed(3);
}
