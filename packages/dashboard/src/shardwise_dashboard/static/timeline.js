// The placement timeline of one rank: which chunk sat where, snapshot by snapshot. One
// column per chunk snapshot (left: first step, right: latest), one row per chunk (top: chunk
// 0). A cell's upper part is the 16-bit payload (blue on the device, orange on the host;
// dark when gathered, light when only this rank's shard is held); its lower third is the fp32
// master and optimizer state (dark blue device, dark orange host, purple the disk tier, grey
// none). History comes
// from /api/v1/placement/{run}?rank=R; live "chunks" events are appended as they come.

const PAYLOAD_COLOURS = { D: "#1f58b8", d: "#8db3ee", H: "#c86f0a", h: "#f3c58a" };
const OPTIM_COLOURS = { D: "#1b3f7a", H: "#8a520d", S: "#6a3d9a", "-": "#b9b9b9" };
const WORDS = {
  D: "payload on device, gathered",
  d: "payload on device, sharded",
  H: "payload on host, gathered",
  h: "payload on host, sharded",
};
const OPTIM_WORDS = {
  D: "optimizer state on device",
  H: "optimizer state on host",
  S: "master and optimizer state on the disk tier",
  "-": "no optimizer state",
};
// The server's optimizer letters (storage.py): S is the disk tier (storage files).
const OPTIM_LETTER = { device: "D", host: "H", disk: "S" };
const MAX_COLUMNS = 2000; // beyond this, every other column is dropped
const ROW_MAX_PX = 10;
const HEIGHT_MAX_PX = 200;

const LETTER = { "device,gathered": "D", "device,sharded": "d", "host,gathered": "H", "host,sharded": "h" };

/** One letter per chunk of a "chunks" event, as the server's placement strings. */
export function placementLetters(chunks) {
  return {
    placement: chunks.map((c) => LETTER[`${c.payload},${c.state}`] ?? "?").join(""),
    optim: chunks.map((c) => OPTIM_LETTER[c.optim] ?? "-").join(""),
  };
}

export class PlacementTimeline {
  constructor(rank) {
    this.rank = rank;
    this.steps = []; // ascending
    this.placement = []; // aligned with steps
    this.optim = [];
    this.dirty = true;
    const figure = document.createElement("figure");
    figure.className = "timeline";
    const caption = document.createElement("figcaption");
    const name = document.createElement("span");
    name.textContent = "placement timeline: chunk (row) by step (column)";
    this.summary = document.createElement("span");
    this.summary.className = "latest";
    caption.append(name, this.summary);
    this.canvas = document.createElement("canvas");
    this.canvas.dataset.timeline = "placement";
    this.canvas.dataset.rank = String(rank);
    this.canvas.dataset.snapshots = "0";
    this.canvas.dataset.changes = "0";
    this.canvas.addEventListener("mousemove", (event) => this.hover(event));
    figure.append(caption, this.canvas);
    this.element = figure;
  }

  /** Add a snapshot (keeps step order; a step seen before is replaced). */
  add(step, placement, optim) {
    let at = this.steps.length;
    while (at > 0 && this.steps[at - 1] > step) at -= 1;
    if (at > 0 && this.steps[at - 1] === step) {
      this.placement[at - 1] = placement;
      this.optim[at - 1] = optim;
    } else {
      this.steps.splice(at, 0, step);
      this.placement.splice(at, 0, placement);
      this.optim.splice(at, 0, optim);
    }
    if (this.steps.length > MAX_COLUMNS) {
      // Keep the first and the latest, drop every other one in between.
      const keep = (_, i) => i % 2 === 0 || i === this.steps.length - 1;
      this.steps = this.steps.filter(keep);
      this.placement = this.placement.filter(keep);
      this.optim = this.optim.filter(keep);
    }
    this.dirty = true;
  }

  addEvent(e) {
    const { placement, optim } = placementLetters(e.chunks);
    this.add(e.step, placement, optim);
  }

  merge(timeline) {
    timeline.steps.forEach((step, i) => this.add(step, timeline.placement[i], timeline.optim[i]));
  }

  /** Cells whose letter differs from the snapshot before: how much the placement moved. */
  changes() {
    let count = 0;
    for (let i = 1; i < this.placement.length; i++) {
      const before = this.placement[i - 1];
      const now = this.placement[i];
      for (let c = 0; c < now.length; c++) if (now[c] !== before[c]) count += 1;
    }
    return count;
  }

  render() {
    if (!this.dirty) return;
    this.dirty = false;
    const canvas = this.canvas;
    const columns = this.steps.length;
    const rows = columns ? Math.max(...this.placement.map((p) => p.length)) : 0;
    const rowPx = rows ? Math.max(2, Math.min(ROW_MAX_PX, Math.floor(HEIGHT_MAX_PX / rows))) : ROW_MAX_PX;
    const width = Math.max(canvas.clientWidth, 100);
    const height = Math.max(rows * rowPx, 20);
    canvas.style.height = `${height}px`;
    const ratio = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const colPx = columns ? width / columns : width;
    let hostCells = 0;
    let diskCells = 0;
    for (let i = 0; i < columns; i++) {
      const x = Math.floor(i * colPx);
      const w = Math.max(1, Math.floor((i + 1) * colPx) - x);
      const placement = this.placement[i];
      const optim = this.optim[i];
      for (let c = 0; c < placement.length; c++) {
        const y = c * rowPx;
        const upper = Math.max(1, Math.round(rowPx * 0.67));
        ctx.fillStyle = PAYLOAD_COLOURS[placement[c]] ?? "#000";
        ctx.fillRect(x, y, w, upper);
        ctx.fillStyle = OPTIM_COLOURS[optim[c]] ?? "#000";
        ctx.fillRect(x, y + upper, w, rowPx - upper);
        if (placement[c] === "H" || placement[c] === "h") hostCells += 1;
        if (optim[c] === "S") diskCells += 1;
      }
    }
    const changes = this.changes();
    canvas.dataset.snapshots = String(columns);
    canvas.dataset.chunks = String(rows);
    canvas.dataset.changes = String(changes);
    canvas.dataset.hostCells = String(hostCells);
    canvas.dataset.diskCells = String(diskCells);
    canvas.dataset.firstStep = columns ? String(this.steps[0]) : "";
    canvas.dataset.lastStep = columns ? String(this.steps[columns - 1]) : "";
    const latest = columns ? this.placement[columns - 1] : "";
    const onHost = [...latest].filter((l) => l === "H" || l === "h").length;
    const onDisk = columns ? [...this.optim[columns - 1]].filter((l) => l === "S").length : 0;
    const disk = onDisk ? `, ${onDisk} on the disk tier` : "";
    this.summary.textContent = columns
      ? `${rows} chunks, ${onHost} on host${disk} now; ${changes} moves over ${columns} snapshots`
      : "no snapshot yet";
  }

  hover(event) {
    const columns = this.steps.length;
    if (!columns) return;
    const box = this.canvas.getBoundingClientRect();
    const i = Math.min(columns - 1, Math.floor(((event.clientX - box.left) / box.width) * columns));
    const rows = this.placement[i].length;
    const c = Math.min(rows - 1, Math.floor(((event.clientY - box.top) / box.height) * rows));
    if (i < 0 || c < 0) return;
    this.canvas.title =
      `step ${this.steps[i]}, chunk ${c}: ${WORDS[this.placement[i][c]] ?? "?"}; ` +
      `${OPTIM_WORDS[this.optim[i][c]] ?? "?"}`;
  }
}
