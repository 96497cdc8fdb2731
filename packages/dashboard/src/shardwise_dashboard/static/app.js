// The dashboard page: a runs list, and for the selected run its overview (overview.js: fits
// one screen at any rank count) and rank cards (chunk map and charts): one per rank up to
// MAX_RANK_CARDS ranks, beyond that only the rank picked in the overview. History comes from
// /api/v1/runs/{id}; live events from the /api/v1/stream Server-Sent Events. Events only
// update state and mark it dirty; drawing happens at most once per animation frame, so 8
// ranks at 10 steps/s cost a few redraws per second each.

import { LineChart, formatBytes, formatNumber } from "./charts.js";
import { renderChunkMap } from "./chunkmap.js";
import { OverviewView } from "./overview.js";
import { PlacementTimeline } from "./timeline.js";

const API = "/api/v1";
const HISTORY_POINTS = 4000;
const MAX_RANK_CARDS = 16;
const $ = (id) => document.getElementById(id);

const state = {
  runs: [], // summaries, newest first
  selected: null, // run id shown
  detailRank: null, // of a large run, the rank whose card is shown
  follow: true, // no explicit choice: show the newest run as it appears
  view: null, // RunView of the selected run
  listDirty: true,
};

// ---- drawing is scheduled, never done per event ------------------------------------------

// Everything is drawn inside animation frames, each part at its own pace: rank headers and
// chunk maps in the next frame after they change, charts at most every CHART_INTERVAL_MS,
// the runs list at most every LIST_INTERVAL_MS (it only shows progress counters).
const CHART_INTERVAL_MS = 200;
const SILENT_AFTER_S = 30;
const LIST_INTERVAL_MS = 500;
const drawnAt = { charts: -Infinity, list: -Infinity };
// Read by the browser tests (data-messages, data-renders, data-render-ms on <body>): stream
// messages received, frames drawn for them, and the time spent drawing.
const counters = { messages: 0, renders: 0, renderMs: 0 };
let frameRequested = false;
let retryTimer = null;

function scheduleRender() {
  if (frameRequested) return;
  frameRequested = true;
  requestAnimationFrame((now) => {
    frameRequested = false;
    const start = performance.now();
    let waitMs = Infinity;
    if (state.listDirty) {
      const wait = drawnAt.list + LIST_INTERVAL_MS - now;
      if (wait <= 0) {
        drawnAt.list = now;
        renderRunList();
      } else waitMs = Math.min(waitMs, wait);
    }
    if (state.view) {
      const chartsDue = now - drawnAt.charts >= CHART_INTERVAL_MS;
      const { drewCharts, chartsPending } = state.view.render(chartsDue);
      if (drewCharts) drawnAt.charts = now;
      if (chartsPending) waitMs = Math.min(waitMs, drawnAt.charts + CHART_INTERVAL_MS - now);
    }
    if (Number.isFinite(waitMs) && retryTimer === null) {
      retryTimer = setTimeout(() => {
        retryTimer = null;
        scheduleRender();
      }, Math.max(waitMs, 0));
    }
    counters.renders += 1;
    counters.renderMs += performance.now() - start;
    document.body.dataset.renders = String(counters.renders);
    document.body.dataset.renderMs = counters.renderMs.toFixed(1);
  });
}

// ---- one rank --------------------------------------------------------------------------

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

class RankView {
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

// ---- one run ---------------------------------------------------------------------------

class RunView {
  constructor(runId, detailRank) {
    this.runId = runId;
    this.detailRank = detailRank;
    this.large = null; // more ranks than cards? known once the overview answered
    this.summary = null;
    this.config = null;
    this.ranks = new Map();
    this.headerDirty = true;
    const section = $("run");
    section.dataset.runId = runId;
    section.dataset.loaded = "false";
    $("ranks").replaceChildren();
    $("no-run-selected").hidden = true;
    $("run-header").hidden = false;
    $("legend").hidden = false;
    this.overview = new OverviewView(
      runId,
      $("overview"),
      (rank) => {
        location.hash = `run=${encodeURIComponent(runId)}&rank=${rank}`;
      },
      (data) => {
        if (this !== state.view) return;
        this.summary = { ...(this.summary ?? {}), ...data, ranks: undefined };
        this.config ??= data.config;
        this.large = data.ranks.length > MAX_RANK_CARDS || (data.world_size ?? 0) > MAX_RANK_CARDS;
        section.dataset.large = String(this.large);
        if (this.large) {
          // It grew past a card per rank: keep only the picked one.
          for (const [rank, view] of this.ranks) {
            if (rank !== this.detailRank) {
              view.element.remove();
              this.ranks.delete(rank);
            }
          }
        }
        this.headerDirty = true;
        scheduleRender();
      },
    );
  }

  /** Whether this rank gets a card (all of a small run; the picked one of a large run). */
  shows(rank) {
    if (this.large === null) return false; // not known yet: history loads after
    return !this.large || rank === this.detailRank;
  }

  rankView(rank) {
    let view = this.ranks.get(rank);
    if (!view) {
      view = new RankView(rank);
      this.ranks.set(rank, view);
      const container = $("ranks");
      const after = [...container.children].find((el) => Number(el.dataset.rank) > rank);
      container.insertBefore(view.element, after ?? null);
    }
    return view;
  }

  apply(e) {
    if (this.shows(e.rank)) this.rankView(e.rank).apply(e);
    this.overview.refreshSoon();
    if (e.type === "run_started" && this.summary) this.summary.world_size = e.world_size;
    if (e.type === "run_started" && !this.config) this.config = e.config;
    if (e.type !== "step" && e.type !== "chunks") this.headerDirty = true;
  }

  merge(detail) {
    this.summary = detail;
    this.config = detail.config;
    for (const r of detail.ranks) {
      if (!this.shows(r.rank)) continue;
      this.rankView(r.rank).merge(r);
      this.loadTimeline(r.rank);
    }
    this.headerDirty = true;
    $("run").dataset.loaded = "true";
  }

  /** A rank's placement history (live "chunks" events then extend it). */
  async loadTimeline(rank) {
    const query = `rank=${rank}`;
    const response = await fetch(`${API}/placement/${encodeURIComponent(this.runId)}?${query}`);
    if (!response.ok || this !== state.view) return;
    const view = this.ranks.get(rank);
    if (!view) return;
    view.timeline.merge(await response.json());
    scheduleRender();
  }

  render(chartsDue) {
    if (this.overview.render()) this.headerDirty = true;
    if (this.headerDirty) {
      this.headerDirty = false;
      renderHeader(this);
    }
    let drewCharts = false;
    let chartsPending = false;
    for (const view of this.ranks.values()) {
      const drawn = view.render(chartsDue);
      drewCharts ||= drawn.drewCharts;
      chartsPending ||= drawn.chartsPending;
    }
    return { drewCharts, chartsPending };
  }
}

function renderHeader(view) {
  const listed = state.runs.find((r) => r.run_id === view.runId);
  const s = listed ?? view.summary;
  $("run-title").textContent = view.runId;
  const facts = [];
  if (s) {
    facts.push(["status", s.status], ["world size", s.world_size ?? "?"]);
    facts.push(["ranks finished", `${s.ranks_finished} / ${s.world_size ?? s.ranks_seen}`]);
    if (s.num_params !== null) facts.push(["parameters", s.num_params.toLocaleString()]);
    facts.push(["started", new Date(s.started * 1000).toLocaleString()]);
  }
  for (const [key, value] of Object.entries(view.config ?? {})) {
    facts.push([key, typeof value === "object" ? JSON.stringify(value) : String(value)]);
  }
  renderWarning(view);
  const dropped = [...view.ranks.values()].reduce((n, r) => n + r.dropped, 0);
  if (dropped) facts.push(["events dropped", String(dropped)]);
  $("run-facts").replaceChildren(
    ...facts.map(([key, value]) => {
      const row = document.createElement("div");
      const dt = document.createElement("dt");
      const dd = document.createElement("dd");
      dt.textContent = key;
      dd.textContent = String(value);
      row.append(dt, dd);
      return row;
    }),
  );
  $("run").dataset.status = s ? s.status : "";
}

/** The engine's warnings, above everything else: one line per distinct text. */
function renderWarning(view) {
  const byText = new Map();
  const add = (text, rank, step, active) => {
    const seen = byText.get(text) ?? { ranks: new Set(), rank, step, active: false };
    seen.ranks.add(rank);
    if (rank < seen.rank) [seen.rank, seen.step] = [rank, step];
    seen.active ||= active;
    byText.set(text, seen);
  };
  for (const r of view.ranks.values()) {
    if (r.warning) add(r.warning.text, r.rank, r.warning.step, r.skippedInARow > 0);
  }
  for (const o of view.overview?.data?.outliers ?? []) {
    if (o.kind === "warning" && !byText.has(o.text)) {
      byText.set(o.text, { ranks: { size: o.num_ranks }, rank: o.rank, step: o.step, active: o.active });
    }
  }
  const banner = $("run-warning");
  banner.hidden = byText.size === 0;
  banner.replaceChildren(
    ...[...byText.entries()].map(([text, w]) => {
      const line = document.createElement("p");
      const state = w.active ? "still skipping" : "stepping again";
      line.textContent = `⚠ ${text} (rank ${w.rank}, step ${w.step}; ${w.ranks.size} rank${w.ranks.size === 1 ? "" : "s"}; ${state})`;
      line.dataset.active = String(w.active);
      return line;
    }),
  );
}

// ---- the runs list ---------------------------------------------------------------------

function renderRunList() {
  state.listDirty = false;
  $("no-runs").hidden = state.runs.length > 0;
  $("run-list").replaceChildren(
    ...state.runs.map((run) => {
      const li = document.createElement("li");
      li.dataset.runId = run.run_id;
      li.dataset.status = run.status;
      if (run.run_id === state.selected) li.className = "selected";
      const id = document.createElement("div");
      id.className = "run-id";
      id.textContent = run.run_id;
      const meta = document.createElement("div");
      meta.className = "run-meta";
      const badge = document.createElement("span");
      badge.className = `status status-${run.status}`;
      badge.textContent = run.status;
      const started = new Date(run.started * 1000).toLocaleTimeString();
      meta.append(badge, ` ${run.world_size ?? "?"} ranks · step ${Math.max(run.last_step, 0)} · ${started}`);
      li.append(id, meta);
      li.addEventListener("click", () => {
        location.hash = `run=${encodeURIComponent(run.run_id)}`;
      });
      return li;
    }),
  );
  if (state.view) state.view.headerDirty = true;
}

let reloadTimer = null;
function refreshRunsSoon() {
  if (reloadTimer !== null) return;
  reloadTimer = setTimeout(() => {
    reloadTimer = null;
    loadRuns();
  }, 300);
}

async function loadRuns() {
  const response = await fetch(`${API}/runs`);
  if (!response.ok) return;
  state.runs = await response.json();
  state.listDirty = true;
  if (state.follow && state.runs.length && state.runs[0].run_id !== state.selected) {
    select(state.runs[0].run_id);
  }
  scheduleRender();
}

// ---- selection and history ---------------------------------------------------------------

function select(runId, detailRank = null) {
  if (state.view) state.view.overview.close();
  state.selected = runId;
  state.detailRank = detailRank;
  state.view = new RunView(runId, detailRank);
  state.listDirty = true;
  loadRun(state.view);
  scheduleRender();
}

async function loadRun(view) {
  // The overview first: it says whether the run is small enough for a card per rank.
  await view.overview.load();
  if (view !== state.view) return; // another run was selected meanwhile
  if (view.large === null) {
    $("run").dataset.loaded = "true"; // nothing stored yet; live events will fill it
    view.large = false;
    return;
  }
  $("rank-hint").hidden = !view.large || view.detailRank !== null;
  if (view.large && view.detailRank === null) {
    $("run").dataset.loaded = "true";
    return;
  }
  // History is thinned to what a chart can show; live events then arrive at full resolution.
  let query = `max_points=${HISTORY_POINTS}`;
  if (view.large) query += `&rank=${view.detailRank}`;
  const response = await fetch(`${API}/runs/${encodeURIComponent(view.runId)}?${query}`);
  if (view !== state.view) return;
  if (!response.ok) return;
  view.merge(await response.json());
  if (view.large) view.ranks.get(view.detailRank)?.element.scrollIntoView({ block: "nearest" });
  scheduleRender();
}

function fromHash() {
  const match = /^#run=([^&]+)(?:&rank=(\d+))?$/.exec(location.hash);
  if (match) {
    state.follow = false;
    const runId = decodeURIComponent(match[1]);
    const rank = match[2] === undefined ? null : Number(match[2]);
    if (runId !== state.selected || rank !== state.detailRank) select(runId, rank);
  }
}

// ---- live events -----------------------------------------------------------------------

function onEvents(events) {
  counters.messages += 1;
  document.body.dataset.messages = String(counters.messages);
  for (const e of events) {
    const run = state.runs.find((r) => r.run_id === e.run_id);
    if (!run || e.type === "run_started" || e.type === "run_finished") refreshRunsSoon();
    else if (e.type === "step" && e.step > run.last_step) {
      run.last_step = e.step;
      state.listDirty = true;
    }
    if (state.view && e.run_id === state.view.runId) state.view.apply(e);
  }
  scheduleRender();
}

function connect() {
  const source = new EventSource(`${API}/stream`);
  const indicator = $("connection");
  // "hello" comes once the server has subscribed this stream: history loaded after it,
  // merged with what the stream brings, misses nothing.
  source.addEventListener("hello", () => {
    indicator.dataset.state = "live";
    indicator.textContent = "live";
    loadRuns();
    if (state.view) loadRun(state.view);
  });
  source.addEventListener("resync", () => {
    if (state.view) state.view.overview.refreshSoon();
    loadRuns();
    if (state.view) loadRun(state.view);
  });
  source.addEventListener("events", (message) => onEvents(JSON.parse(message.data)));
  source.addEventListener("error", () => {
    // EventSource reconnects by itself; "hello" will bring the page up to date.
    indicator.dataset.state = "offline";
    indicator.textContent = "reconnecting";
  });
}

window.addEventListener("hashchange", fromHash);
setInterval(() => {
  // Staleness is the server's judgement (its --stale-after): ask again while runs are live.
  if (state.runs.some((r) => r.status === "running" || r.status === "stale")) loadRuns();
  if (!state.view) return;
  for (const r of state.view.ranks.values()) if (r.status === "running") r.dirty = true;
  scheduleRender();
}, 5000);
window.addEventListener("resize", () => {
  if (state.view) {
    for (const r of state.view.ranks.values()) {
      r.chartsDirty = true;
      r.timeline.dirty = true;
    }
  }
  scheduleRender();
});
fromHash();
connect();
