// One rank's card: its chunk map, placement timeline and charts (loss with the evaluation
// loss, loss scale, memory, bytes on the wire and moved, step time, grad norm). The card keeps
// the rank's series; the page (app.js) decides when it draws.

import { LineChart, formatBytes, formatNumber } from "./charts.js";
import { renderChunkMap } from "./chunkmap.js";
import { PlacementTimeline } from "./timeline.js";

// A running rank from which nothing arrived for this long says so in its header.
const SILENT_AFTER_S = 30;

const CHARTS = [
  // The evaluation loss is a sparse series beside the training loss (see RankView.evals).
  { key: "loss", title: "loss: train / eval", series: [["loss", "#2f6fd6"], ["eval", "#e08a1e"]], format: formatNumber, marks: true },
  { key: "loss-scale", title: "loss scale (log2)", series: [["scale", "#7a3fd6"]], format: formatNumber, log2: true, marks: true },
  { key: "memory", title: "memory: device / host / disk tier", series: [["device", "#2f6fd6"], ["host", "#e08a1e"], ["disk", "#6a3d9a"]], format: formatBytes },
  // Bytes on the wire against what the same collectives would have sent unquantized (the
  // engine computes it from chunk sizes and dtypes; see comm_bytes_unquantized).
  { key: "comm", title: "wire bytes per step: sent / unquantized", series: [["sent", "#2e9d4f"], ["unquantized", "#9aa0a6"]], format: formatBytes },
  { key: "moved", title: "bytes moved per step: to device / to host / to disk / from disk", series: [["to_device", "#2f6fd6"], ["to_host", "#e08a1e"], ["to_disk", "#6a3d9a"], ["from_disk", "#b69ad6"]], format: formatBytes },
  { key: "step-time", title: "step time", series: [["ms", "#444448"]], format: (v) => `${formatNumber(v)} ms` },
  { key: "grad-norm", title: "grad norm", series: [["norm", "#8a520d"]], format: formatNumber },
];

export class RankView {
  constructor(rank) {
    this.rank = rank;
    this.steps = []; // sorted step numbers; every series below is aligned with it
    this.seen = new Set();
    this.series = { loss: [], scale: [], device: [], host: [], disk: [], sent: [], unquantized: [], to_device: [], to_host: [], to_disk: [], from_disk: [], ms: [], norm: [] };
    this.overflows = [];
    // Evaluations, sorted by step: every rank reports the same (all-reduced) loss.
    this.evals = { steps: [], loss: [] };
    this.chunks = null;
    this.chunksDirty = true;
    this.status = "running";
    this.host = "";
    this.error = null;
    this.warning = null; // the engine's latest warning: {text, step}
    this.skippedInARow = 0;
    this.dropped = 0;
    this.droppedSeen = new Set();
    this.lastSeen = 0; // the newest event's time (the rank's clock)
    this.dirty = true; // header text
    this.chartsDirty = true;
    this.build();
  }

  build() {
    const card = document.createElement("article");
    card.className = "rank";
    card.dataset.rank = String(this.rank);
    const title = document.createElement("h3");
    this.meta = document.createElement("span");
    this.meta.className = "rank-meta";
    title.append(`rank ${this.rank} `, this.meta);
    this.map = document.createElement("div");
    this.map.className = "chunk-map";
    this.map.dataset.rank = String(this.rank);
    this.map.dataset.chunkCount = "0";
    this.errorLine = document.createElement("p");
    this.errorLine.className = "error";
    this.errorLine.hidden = true;
    this.warningLine = document.createElement("p");
    this.warningLine.className = "warning";
    this.warningLine.hidden = true;
    const charts = document.createElement("div");
    charts.className = "charts";
    this.charts = CHARTS.map((spec) => {
      const figure = document.createElement("figure");
      figure.className = "chart";
      const caption = document.createElement("figcaption");
      const name = document.createElement("span");
      name.textContent = spec.title;
      const latest = document.createElement("span");
      latest.className = "latest";
      const values = document.createElement("span");
      values.append(latest);
      let latestEval = null;
      if (spec.key === "loss") {
        // The latest evaluation, beside the latest training loss, in its series' colour.
        latestEval = document.createElement("span");
        latestEval.className = "latest-eval";
        latestEval.hidden = true;
        values.append(" ", latestEval);
      }
      caption.append(name, values);
      const canvas = document.createElement("canvas");
      canvas.dataset.chart = spec.key;
      canvas.dataset.rank = String(this.rank);
      canvas.dataset.points = "0";
      figure.append(caption, canvas);
      charts.append(figure);
      const chart = new LineChart(canvas, {
        series: spec.series.map(([name, colour]) => ({ name, colour })),
        log2: spec.log2,
        format: spec.format,
      });
      return { spec, chart, latest, latestEval };
    });
    this.timeline = new PlacementTimeline(this.rank);
    card.append(title, this.warningLine, this.map, this.timeline.element, this.errorLine, charts);
    this.element = card;
  }

  addStep(e) {
    if (this.seen.has(e.step)) return;
    this.seen.add(e.step);
    const total = (bytes) => Object.values(bytes).reduce((a, b) => a + b, 0);
    const sent = total(e.comm_bytes);
    // Unknown (null) from ranks of a shardwise from before it.
    const unquantized = e.comm_bytes_unquantized ? total(e.comm_bytes_unquantized) : null;
    const values = {
      loss: e.loss, scale: e.loss_scale, device: e.memory.device, host: e.memory.host,
      // The disk tier's (absent from events of runs from before it: zero).
      disk: e.memory.disk ?? 0,
      sent, unquantized, to_device: e.moved_bytes.to_device, to_host: e.moved_bytes.to_host,
      to_disk: e.moved_bytes.to_disk ?? 0, from_disk: e.moved_bytes.from_disk ?? 0,
      ms: e.step_time_s * 1000, norm: e.grad_norm,
    };
    // Steps nearly always arrive in order; an old one is inserted where it belongs.
    let at = this.steps.length;
    if (at > 0 && this.steps[at - 1] > e.step) {
      let lo = 0;
      while (lo < at) {
        const mid = (lo + at) >> 1;
        if (this.steps[mid] < e.step) lo = mid + 1;
        else at = mid;
      }
    }
    this.steps.splice(at, 0, e.step);
    for (const [key, value] of Object.entries(values)) this.series[key].splice(at, 0, value);
    if (e.overflow) this.overflows.push(e.step);
    if (e.step === this.steps[this.steps.length - 1]) this.skippedInARow = e.skipped_in_a_row ?? 0;
    if (e.warning && (!this.warning || this.warning.step < e.step)) {
      this.warning = { text: e.warning, step: e.step };
    }
    this.dirty = true;
    this.chartsDirty = true;
  }

  addEval(e) {
    const { steps, loss } = this.evals;
    let at = steps.length;
    while (at > 0 && steps[at - 1] > e.step) at--;
    if (at > 0 && steps[at - 1] === e.step) return; // seen (history and the stream overlap)
    steps.splice(at, 0, e.step);
    loss.splice(at, 0, e.loss);
    this.chartsDirty = true;
  }

  setChunks(e) {
    this.timeline.addEvent(e);
    if (this.chunks && this.chunks.step > e.step) return;
    this.chunks = e;
    this.chunksDirty = true;
    this.dirty = true;
  }

  apply(e) {
    this.lastSeen = Math.max(this.lastSeen, e.time);
    if (this.status === "stale") this.status = "running"; // it spoke again
    if (e.type === "step") this.addStep(e);
    else if (e.type === "eval") this.addEval(e);
    else if (e.type === "chunks") this.setChunks(e);
    else if (e.type === "run_started") this.host = e.host;
    else if (e.type === "run_finished") {
      this.status = e.status;
      this.error = e.error;
    } else if (e.type === "dropped") {
      const key = `${e.time}:${e.count}`;
      if (!this.droppedSeen.has(key)) {
        this.droppedSeen.add(key);
        this.dropped += e.count;
      }
    }
    this.dirty = true;
  }

  merge(r) {
    for (const e of r.steps) this.addStep(e);
    for (const e of r.evals ?? []) this.addEval(e);
    if (r.chunks) this.setChunks(r.chunks);
    if (r.status !== "running" || this.status === "stale") this.status = r.status;
    this.error = r.error ?? this.error;
    if (r.warning && (!this.warning || this.warning.step < r.warning_step)) {
      this.warning = { text: r.warning, step: r.warning_step };
    }
    if (r.last_step >= (this.steps[this.steps.length - 1] ?? -1)) {
      this.skippedInARow = r.skipped_in_a_row ?? 0;
    }
    this.host = r.host ?? this.host;
    this.dropped = Math.max(this.dropped, r.dropped);
    this.lastSeen = Math.max(this.lastSeen, r.last_seen);
    this.dirty = true;
  }

  /** Draw what changed; charts only when `chartsDue`. Says whether charts were drawn and
   * whether some still wait for their turn. */
  render(chartsDue) {
    if (this.dirty) {
      this.dirty = false;
      const last = this.steps.length ? this.steps[this.steps.length - 1] : null;
      const parts = [this.host, this.status, last === null ? "no step yet" : `step ${last}`];
      if (this.dropped) parts.push(`${this.dropped} events dropped`);
      // A rank that died without a word (killed, machine lost) stays "running": say so.
      const silentS = Date.now() / 1000 - this.lastSeen;
      const silent = this.status === "running" && this.lastSeen > 0 && silentS > SILENT_AFTER_S;
      if (silent) parts.push(`silent for ${Math.round(silentS)} s`);
      this.element.dataset.silent = String(silent);
      this.meta.textContent = parts.filter(Boolean).join(" · ");
      this.element.dataset.status = this.status;
      this.element.dataset.steps = String(this.steps.length);
      this.errorLine.hidden = !this.error;
      this.errorLine.textContent = this.error ?? "";
      this.warningLine.hidden = !this.warning;
      this.element.dataset.warning = this.warning ? this.warning.text : "";
      if (this.warning) {
        const now = this.skippedInARow > 0 ? `, ${this.skippedInARow} skipped in a row now` : ", stepping again since";
        this.warningLine.textContent = `⚠ step ${this.warning.step}: ${this.warning.text}${now}`;
      }
    }
    if (this.chunksDirty) {
      this.chunksDirty = false;
      renderChunkMap(this.map, this.chunks);
    }
    this.timeline.render();
    if (!this.chartsDirty) return { drewCharts: false, chartsPending: false };
    if (!chartsDue) return { drewCharts: false, chartsPending: true };
    this.chartsDirty = false;
    const s = this.series;
    const data = {
      loss: [s.loss, { xs: this.evals.steps, ys: this.evals.loss }], "loss-scale": [s.scale], memory: [s.device, s.host, s.disk],
      comm: [s.sent, s.unquantized], moved: [s.to_device, s.to_host, s.to_disk, s.from_disk], "step-time": [s.ms], "grad-norm": [s.norm],
    };
    for (const { spec, chart, latest, latestEval } of this.charts) {
      const ys = data[spec.key];
      chart.setData(this.steps, ys, spec.marks ? this.overflows : []);
      chart.draw();
      const value = ys[0].length ? ys[0][ys[0].length - 1] : null;
      latest.textContent = value === null ? "" : spec.format(value);
      if (spec.key === "comm") this.renderWire(latest, ys);
      if (latestEval) this.renderLatestEval(latestEval, spec.format);
    }
    return { drewCharts: true, chartsPending: false };
  }

  /** "1.2 MiB (0.27 of unquantized)": the latest step's bytes on the wire and their share of
   * what it would have sent unquantized; both exact in data attributes (data-unquantized-bytes
   * and data-wire-ratio are empty when the rank did not report the unquantized figure). */
  renderWire(element, [sent, unquantized]) {
    const last = sent.length - 1;
    const bytes = last >= 0 ? sent[last] : null;
    const whole = last >= 0 ? unquantized[last] : null;
    element.dataset.wireBytes = bytes === null ? "" : String(bytes);
    element.dataset.unquantizedBytes = whole === null ? "" : String(whole);
    const ratio = bytes !== null && whole ? bytes / whole : null;
    element.dataset.wireRatio = ratio === null ? "" : String(ratio);
    if (ratio !== null) element.textContent += ` (${ratio.toFixed(2)} of unquantized)`;
  }

  /** "eval 2.88 @ 249": the latest evaluation; its exact loss and step in data attributes
   * (data-eval-loss is empty when the loss was not finite). */
  renderLatestEval(element, format) {
    const { steps, loss } = this.evals;
    element.hidden = steps.length === 0;
    if (!steps.length) return;
    const value = loss[loss.length - 1];
    const step = steps[steps.length - 1];
    element.dataset.evalLoss = value === null ? "" : String(value);
    element.dataset.evalStep = String(step);
    element.dataset.evals = String(steps.length);
    element.textContent = `eval ${value === null ? "n/a" : format(value)} @ ${step}`;
  }
}
