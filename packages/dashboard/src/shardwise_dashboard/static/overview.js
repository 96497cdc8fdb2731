// The one-screen overview of a run, at any rank count: ranks by status, the outlier ranks
// (each a link to its detail), a rank x chunk heatmap of placement, and per-step
// distributions across ranks (min / median / max). Its data is the server's aggregate
// (/api/v1/overview/{run}): the page never holds one series per rank of a large run. Live,
// it asks again for the steps after the last one it has, at most once a second.

import { LineChart, formatBytes, formatNumber } from "./charts.js";

const API = "/api/v1";
const HISTORY_STEPS = 300;
const REFRESH_MS = 1000;
// Colours of placement letters (see storage.py): payload on device / host, gathered / sharded.
const PLACEMENT_RGB = {
  D: [47, 111, 214],
  d: [169, 196, 239],
  H: [224, 138, 30],
  h: [242, 205, 156],
};
const MISSING_RGB = [228, 228, 224];
const STATUS_RGB = {
  running: [46, 157, 79],
  finished: [107, 107, 112],
  failed: [214, 47, 47],
  stale: [176, 125, 18],
};

const DISTRIBUTIONS = [
  { key: "step_time_s", title: "step time", format: (v) => `${formatNumber(v * 1000)} ms` },
  { key: "sent_bytes", title: "bytes sent", format: formatBytes },
  { key: "moved_bytes", title: "bytes moved host<->device", format: formatBytes },
  { key: "mem_device", title: "memory on device", format: formatBytes },
  { key: "mem_host", title: "memory on host", format: formatBytes },
];

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export class OverviewView {
  /**
   * @param {string} runId
   * @param {HTMLElement} container
   * @param {(rank: number) => void} onPickRank
   * @param {(overview: object) => void} onData called after each response is merged
   */
  constructor(runId, container, onPickRank, onData) {
    this.runId = runId;
    this.onPickRank = onPickRank;
    this.onData = onData;
    this.data = null; // the latest response, its steps merged with the earlier ones
    this.steps = null; // {step: [], ranks: [], <metric>: {min, median, max}}
    this.inFlight = false;
    this.again = false;
    this.lastRefresh = -Infinity;
    this.timer = null;
    this.dirty = false;
    this.build(container);
  }

  build(container) {
    container.replaceChildren();
    container.hidden = false;
    this.statusLine = el("p", "overview-status");
    const outliers = el("section", "outliers");
    outliers.append(el("h3", "", "Look here first"));
    this.outlierList = el("ol");
    this.outlierList.id = "outliers";
    outliers.append(this.outlierList);
    const heat = el("section", "heatmap-box");
    heat.append(el("h3", "", "Placement: rank (rows) x chunk (columns)"));
    this.heatmap = el("canvas");
    this.heatmap.id = "heatmap";
    this.heatmap.dataset.ranks = "0";
    this.heatmap.addEventListener("mousemove", (e) => this.hover(e));
    this.heatmap.addEventListener("click", (e) => {
      const at = this.cellAt(e);
      if (at) this.onPickRank(at.rank);
    });
    const legend = el("p", "heatmap-legend");
    for (const [letter, name] of [
      ["D", "device, gathered"],
      ["d", "device, sharded"],
      ["H", "host, gathered"],
      ["h", "host, sharded"],
    ]) {
      const swatch = el("span", "swatch");
      swatch.style.background = `rgb(${PLACEMENT_RGB[letter].join(",")})`;
      legend.append(swatch, ` ${name} `);
    }
    legend.append(el("span", "", "· left edge: rank status"));
    heat.append(this.heatmap, legend);
    const dists = el("section", "distributions");
    dists.append(el("h3", "", "Across ranks per step: max / median / min"));
    const charts = el("div", "charts");
    this.charts = DISTRIBUTIONS.map((spec) => {
      const figure = el("figure", "chart");
      const caption = el("figcaption");
      const latest = el("span", "latest");
      caption.append(el("span", "", spec.title), latest);
      const canvas = el("canvas");
      canvas.dataset.distribution = spec.key;
      canvas.dataset.points = "0";
      figure.append(caption, canvas);
      charts.append(figure);
      const chart = new LineChart(canvas, {
        series: [
          { name: "max", colour: "#d62f2f" },
          { name: "median", colour: "#2f6fd6" },
          { name: "min", colour: "#2e9d4f" },
        ],
        format: spec.format,
      });
      return { spec, chart, latest };
    });
    dists.append(charts);
    const grid = el("div", "overview-grid");
    grid.append(heat, outliers);
    container.append(this.statusLine, grid, dists);
    this.container = container;
  }

  /** Ask the server again soon (live events of this run arrived), at most once a second. */
  refreshSoon() {
    if (this.inFlight) {
      this.again = true;
      return;
    }
    if (this.timer !== null) return;
    const wait = Math.max(0, this.lastRefresh + REFRESH_MS - performance.now());
    this.timer = setTimeout(() => {
      this.timer = null;
      this.load();
    }, wait);
  }

  async load() {
    this.inFlight = true;
    this.lastRefresh = performance.now();
    try {
      const last = this.steps && this.steps.step.length ? this.steps.step[this.steps.step.length - 1] : null;
      // The last steps may have been reported by some ranks only: ask for them again.
      const query = last === null ? `steps=${HISTORY_STEPS}` : `steps=12&since_step=${Math.max(-1, last - 3)}`;
      const response = await fetch(`${API}/overview/${encodeURIComponent(this.runId)}?${query}`);
      if (!response.ok) return;
      const data = await response.json();
      this.merge(data, last === null ? -1 : Math.max(-1, last - 3));
      this.onData(data);
    } finally {
      this.inFlight = false;
      if (this.again) {
        this.again = false;
        this.refreshSoon();
      }
    }
  }

  merge(data, since) {
    const fresh = data.steps;
    if (!this.steps || since < 0) this.steps = fresh;
    else {
      const keep = this.steps.step.findIndex((s) => s > since);
      const cut = keep < 0 ? this.steps.step.length : keep;
      const drop = Math.max(0, cut + fresh.step.length - HISTORY_STEPS * 4);
      const join = (a, b) => a.slice(drop, cut).concat(b);
      const merged = { step: join(this.steps.step, fresh.step), ranks: join(this.steps.ranks, fresh.ranks) };
      for (const { key } of DISTRIBUTIONS) {
        merged[key] = {};
        for (const part of ["min", "median", "max"]) merged[key][part] = join(this.steps[key][part], fresh[key][part]);
      }
      this.steps = merged;
    }
    this.data = data;
    this.dirty = true;
  }

  /** Draw, if something changed (called from the page's animation frame). */
  render() {
    if (!this.dirty || !this.data) return false;
    this.dirty = false;
    this.renderStatus();
    this.renderOutliers();
    this.renderHeatmap();
    for (const { spec, chart, latest } of this.charts) {
      const series = this.steps[spec.key];
      chart.setData(this.steps.step, [series.max, series.median, series.min], []);
      chart.draw();
      const n = series.median.length;
      latest.textContent = n ? `${spec.format(series.median[n - 1])} median` : "";
    }
    this.container.dataset.lastStep = String(this.data.last_step);
    this.container.dataset.ranks = String(this.data.ranks.length);
    return true;
  }

  renderStatus() {
    const d = this.data;
    const counts = Object.entries(d.rank_status)
      .sort((a, b) => b[1] - a[1])
      .map(([status, n]) => `${n} ${status}`)
      .join(", ");
    const lastCount = this.steps.ranks.length ? this.steps.ranks[this.steps.ranks.length - 1] : 0;
    this.statusLine.textContent =
      `${d.ranks.length.toLocaleString()} ranks: ${counts} · step ${Math.max(d.last_step, 0)}` +
      ` (reported by ${lastCount.toLocaleString()})`;
  }

  renderOutliers() {
    const items = this.data.outliers.map((o) => {
      const li = el("li", `outlier outlier-${o.kind}`);
      li.dataset.kind = o.kind;
      li.dataset.rank = String(o.rank);
      const link = el("button", "rank-link", `rank ${o.rank}`);
      link.type = "button";
      link.addEventListener("click", () => this.onPickRank(o.rank));
      li.append(el("span", "outlier-label", o.label), link, el("span", "outlier-detail", describe(o)));
      return li;
    });
    if (!items.length) items.push(el("li", "outlier-none", "nothing stands out"));
    this.outlierList.replaceChildren(...items);
  }

  renderHeatmap() {
    const ranks = this.data.ranks;
    const chunks = ranks.reduce((n, r) => Math.max(n, r.placement ? r.placement.length : 0), 0);
    const canvas = this.heatmap;
    canvas.dataset.ranks = String(ranks.length);
    canvas.dataset.chunks = String(chunks);
    // A few ranks or chunks get cells of at most 14 px, not the whole box.
    canvas.style.maxWidth = `${(chunks + 2) * 14}px`;
    canvas.style.height = `${Math.min(260, Math.max(28, ranks.length * 14))}px`;
    const ratio = window.devicePixelRatio || 1;
    const cw = Math.max(1, Math.round(canvas.clientWidth * ratio));
    const ch = Math.max(1, Math.round(canvas.clientHeight * ratio));
    // [Note: a heatmap that keeps the odd rank] With more ranks than pixel rows, a row holds
    // several ranks; averaging their colours would wash one rank with chunks on the host into
    // a faint tint. So each chunk column's most common placement is the background, a row
    // shows a rank that differs from it wherever one does, and its status edge shows its
    // worst rank (failed, then stale).
    const per = Math.max(1, Math.ceil(ranks.length / ch));
    const rows = Math.max(1, Math.ceil(ranks.length / per));
    const majority = [];
    for (let x = 0; x < chunks; x++) {
      const counts = {};
      for (const r of ranks) {
        const letter = (r.placement ?? "")[x];
        if (letter) counts[letter] = (counts[letter] ?? 0) + 1;
      }
      majority.push(Object.entries(counts).sort((a, b) => b[1] - a[1])[0]?.[0]);
    }
    const worst = { failed: 3, stale: 2, running: 1, finished: 0 };
    const w = chunks + 2;
    const image = new ImageData(w, rows);
    const put = (x, y, rgb) => {
      const i = 4 * (y * w + x);
      image.data.set([rgb[0], rgb[1], rgb[2], 255], i);
    };
    this.binRanks = [];
    for (let y = 0; y < rows; y++) {
      const members = ranks.slice(y * per, (y + 1) * per);
      let shown = members[0];
      let status = members[0].status;
      const letters = majority.slice();
      for (const r of members) {
        if ((worst[r.status] ?? 0) > (worst[status] ?? 0)) {
          status = r.status;
          shown = r;
        }
        const own = r.placement ?? "";
        for (let x = 0; x < chunks; x++) {
          if (own[x] !== majority[x] && letters[x] === majority[x]) {
            letters[x] = own[x];
            if (shown === members[0] && status === members[0].status) shown = r;
          }
        }
      }
      this.binRanks.push({ shown, first: members[0].rank, last: members[members.length - 1].rank });
      put(0, y, STATUS_RGB[status] ?? MISSING_RGB);
      put(1, y, STATUS_RGB[status] ?? MISSING_RGB);
      for (let x = 0; x < chunks; x++) put(x + 2, y, PLACEMENT_RGB[letters[x]] ?? MISSING_RGB);
    }
    canvas.dataset.rowsPerPixel = String(per);
    // Read by the browser test: chunks whose payload is on the host, over all ranks.
    canvas.dataset.hostChunks = String(
      ranks.reduce((n, r) => n + ((r.placement ?? "").match(/[Hh]/g)?.length ?? 0), 0),
    );
    this.chunkCount = chunks;
    if (canvas.width !== cw || canvas.height !== ch) {
      canvas.width = cw;
      canvas.height = ch;
    }
    const off = new OffscreenCanvas(w, rows);
    off.getContext("2d").putImageData(image, 0, 0);
    const ctx = canvas.getContext("2d");
    ctx.imageSmoothingEnabled = false;
    ctx.clearRect(0, 0, cw, ch);
    ctx.drawImage(off, 0, 0, cw, ch);
  }

  cellAt(e) {
    if (!this.binRanks || !this.binRanks.length) return null;
    const box = this.heatmap.getBoundingClientRect();
    const y = Math.floor(((e.clientY - box.top) / box.height) * this.binRanks.length);
    const x = Math.floor(((e.clientX - box.left) / box.width) * (this.chunkCount + 2)) - 2;
    const bin = this.binRanks[Math.min(Math.max(y, 0), this.binRanks.length - 1)];
    return { rank: bin.shown.rank, row: bin.shown, bin, chunk: x };
  }

  hover(e) {
    const at = this.cellAt(e);
    if (!at) return;
    const letter = at.chunk >= 0 ? (at.row.placement ?? "")[at.chunk] : undefined;
    const where = { D: "device, gathered", d: "device, sharded", H: "host, gathered", h: "host, sharded" }[letter];
    const chunk = at.chunk >= 0 && where ? `, chunk ${at.chunk}: ${where}` : "";
    const span = at.bin.first === at.bin.last ? "" : ` (row of ranks ${at.bin.first}-${at.bin.last})`;
    this.heatmap.title = `rank ${at.rank}${span}: ${at.row.status}, step ${at.row.last_step}${at.row.host ? `, ${at.row.host}` : ""}${chunk} — click for its detail`;
  }

  close() {
    if (this.timer !== null) clearTimeout(this.timer);
    this.container.hidden = true;
  }
}

function describe(o) {
  const others = o.num_ranks > 1 ? ` (${o.num_ranks.toLocaleString()} ranks)` : "";
  if (o.kind === "warning") return `step ${o.step}: ${o.text}${others}${o.active ? "" : " · stepping again"}`;
  if (o.kind === "failed") return `${o.text ?? "failed"}${others}`;
  if (o.kind === "stale") return `silent for ${Math.round(Date.now() / 1000 - o.received)} s${others}`;
  if (o.kind === "overflow") return `step ${o.step}${others}`;
  const value = o.unit === "s" ? `${formatNumber(o.value * 1000)} ms` : formatBytes(o.value);
  const median = o.unit === "s" ? `${formatNumber(o.median * 1000)} ms` : formatBytes(o.median);
  const ratio = o.median > 0 ? ` (${(o.value / o.median).toFixed(2)}x)` : "";
  const over = o.window > 1 ? ` over the last ${o.window} steps` : "";
  return `${value} against a median of ${median}${ratio}${over}`;
}
