// The dashboard page: a runs list, and for the selected run its overview (overview.js: fits
// one screen at any rank count) and rank cards (rank.js: chunk map and charts): one per rank up to
// MAX_RANK_CARDS ranks, beyond that only the rank picked in the overview. History comes from
// /api/v1/runs/{id}; live events from the /api/v1/stream Server-Sent Events. Events only
// update state and mark it dirty; drawing happens at most once per animation frame, so 8
// ranks at 10 steps/s cost a few redraws per second each.

import { OverviewView } from "./overview.js";
import { RankView } from "./rank.js";

const API = "/api/v1";
const HISTORY_POINTS = 4000;
const MAX_RANK_CARDS = 16;
const $ = (id) => document.getElementById(id);

const state = {
  runs: [], // summaries, newest first
  runsLoaded: false, // whether the server has answered the runs list once
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
  $("run-title").textContent = s?.run_name ?? view.runId;
  const facts = [];
  if (s?.run_name) facts.push(["run id", view.runId]);
  if (s?.entry_point) facts.push(["entry point", s.entry_point]);
  if (s?.script) facts.push(["script", s.script]);
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
  // "No run yet" only once the server said so: the page's first paint comes before its answer.
  $("runs-loading").hidden = state.runsLoaded;
  $("no-runs").hidden = !state.runsLoaded || state.runs.length > 0;
  $("run-list").replaceChildren(
    ...state.runs.map((run) => {
      const li = document.createElement("li");
      li.dataset.runId = run.run_id;
      li.dataset.status = run.status;
      if (run.run_id === state.selected) li.className = "selected";
      // What tells runs apart: the name the user gave it, what started it and the script.
      li.dataset.runName = run.run_name ?? "";
      li.dataset.entryPoint = run.entry_point ?? "";
      li.dataset.script = run.script ?? "";
      const name = document.createElement("div");
      name.className = "run-name";
      name.textContent = run.run_name ?? "";
      name.hidden = !run.run_name;
      const id = document.createElement("div");
      id.className = "run-id";
      id.textContent = run.run_id;
      const source = document.createElement("div");
      source.className = "run-source";
      source.textContent = [run.entry_point, scriptName(run.script)].filter(Boolean).join(" · ");
      source.title = run.script ?? "";
      const meta = document.createElement("div");
      meta.className = "run-meta";
      const badge = document.createElement("span");
      badge.className = `status status-${run.status}`;
      badge.textContent = run.status;
      const started = new Date(run.started * 1000).toLocaleTimeString();
      meta.append(badge, ` ${run.world_size ?? "?"} ranks · step ${Math.max(run.last_step, 0)} · ${started}`);
      li.append(name, id, source, meta);
      li.addEventListener("click", () => {
        location.hash = `run=${encodeURIComponent(run.run_id)}`;
      });
      return li;
    }),
  );
  if (state.view) state.view.headerDirty = true;
}

/** "train.py" of "/home/me/project/train.py". */
function scriptName(path) {
  return path ? path.split("/").pop() : "";
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
  state.runsLoaded = true;
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
  if (!response.ok) return;
  const detail = await response.json();
  // Checked after the last wait: a run picked meanwhile owns the rank cards now, and this
  // one's would be added beside them.
  if (view !== state.view) return;
  view.merge(detail);
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
loadRuns(); // at once, not after the live stream connects: the list is what the page shows first
connect();
