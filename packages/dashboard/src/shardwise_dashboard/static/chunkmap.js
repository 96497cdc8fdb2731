// The chunk map of one rank: one cell per chunk. The upper part of a cell is the 16-bit
// payload (blue on the device, orange on the host; solid when gathered, striped when only
// this rank's shard is held); the lower band is the fp32 master weights and optimizer state
// (dark blue device, dark orange host, purple the disk tier, grey when the chunk has nothing
// to train).

function describe(chunk) {
  const tensors = Object.entries(chunk.tensor_states)
    .map(([state, count]) => `${state} ${count}`)
    .join(", ");
  const optim =
    chunk.optim === null
      ? "no optimizer state (frozen)"
      : chunk.optim === "disk"
        ? "master and optimizer state on the disk tier"
        : `optimizer state on ${chunk.optim}`;
  return (
    `chunk ${chunk.id}: ${chunk.numel.toLocaleString()} elements, ${chunk.state}` +
    `${chunk.sharded ? "" : " (kept whole)"}, payload on ${chunk.payload}, ${optim}; tensors: ${tensors}`
  );
}

function classes(chunk) {
  return `cell payload-${chunk.payload} state-${chunk.state} optim-${chunk.optim ?? "none"}`;
}

/** Render a "chunks" event into `container` (reusing cells when the chunk count holds). */
export function renderChunkMap(container, snapshot) {
  const chunks = snapshot ? snapshot.chunks : [];
  container.dataset.chunkCount = String(chunks.length);
  container.dataset.step = snapshot ? String(snapshot.step) : "";
  if (container.children.length !== chunks.length) {
    container.replaceChildren(...chunks.map(() => document.createElement("span")));
  }
  chunks.forEach((chunk, i) => {
    const cell = container.children[i];
    const name = classes(chunk);
    if (cell.className !== name) cell.className = name;
    cell.dataset.chunkId = String(chunk.id);
    cell.dataset.payload = chunk.payload;
    cell.dataset.state = chunk.state;
    cell.dataset.optim = chunk.optim ?? "none";
    cell.title = describe(chunk);
  });
}
