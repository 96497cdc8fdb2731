"""The shape of the dashboard's SQLite file: its tables, their version, and the migrations
from older versions (run at start, in one transaction, by `RunStore`)."""

# Version of the tables below; bumped when they change shape (see MIGRATIONS).
DB_VERSION = 3

TABLES = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    started REAL NOT NULL,       -- earliest event time seen
    last_seen REAL NOT NULL,     -- latest event time seen (ranks' clocks)
    world_size INTEGER,          -- from run_started; NULL until one arrives
    num_params INTEGER,
    config TEXT,                 -- JSON object
    received REAL,               -- this server's clock at the latest event: staleness
    run_name TEXT,               -- from run_started (NULL: not given, or an older shardwise)
    entry_point TEXT,            -- the front door that started the run
    script TEXT                  -- the command's script
);
CREATE TABLE IF NOT EXISTS ranks (
    run_id TEXT NOT NULL,
    rank INTEGER NOT NULL,
    status TEXT NOT NULL,        -- running | finished | failed
    error TEXT,
    host TEXT,
    last_step INTEGER NOT NULL,  -- -1 before the first step
    num_steps INTEGER NOT NULL,
    dropped INTEGER NOT NULL,    -- events the rank reported it could not deliver
    last_seen REAL NOT NULL,
    received REAL,               -- this server's clock at the rank's latest event
    skipped_in_a_row INTEGER NOT NULL DEFAULT 0,  -- at the rank's latest step
    warning TEXT,                -- the engine's warning at warning_step, the latest that had one
    warning_step INTEGER,
    first_overflow INTEGER,      -- earliest overflowed step
    first_overflow_time REAL,
    placement TEXT,              -- one letter per chunk of the latest snapshot (see _placement)
    placement_step INTEGER,
    PRIMARY KEY (run_id, rank)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL,
    rank INTEGER NOT NULL,
    type TEXT NOT NULL,
    step INTEGER,
    time REAL NOT NULL,
    body TEXT NOT NULL,          -- the validated event as JSON (zlib-compressed BLOB if large)
    -- step events only (NULL otherwise): what the overview aggregates across ranks
    step_time_s REAL,
    sent_bytes INTEGER,
    moved_bytes INTEGER,
    mem_device INTEGER,
    mem_host INTEGER,
    overflow INTEGER
);
-- One rank's steps and snapshots (the detail of a rank of a large run, the latest snapshots).
CREATE INDEX IF NOT EXISTS events_by_run ON events (run_id, type, rank, step);
-- Covers the overview's read of recent steps: it never touches the rows and their bodies.
CREATE INDEX IF NOT EXISTS step_metrics ON events (
    run_id, step, rank, step_time_s, sent_bytes, moved_bytes, mem_device, mem_host, overflow
) WHERE type = 'step';
"""

# From version 1 (before the overview): add the columns, fill them from the bodies. From
# version 2 (before runs said what started them): the run_started bodies stored before never
# held the three new columns' values, so they stay NULL.
MIGRATIONS = {
    1: """
ALTER TABLE runs ADD COLUMN received REAL;
UPDATE runs SET received = last_seen;
ALTER TABLE ranks ADD COLUMN received REAL;
UPDATE ranks SET received = last_seen;
ALTER TABLE ranks ADD COLUMN skipped_in_a_row INTEGER NOT NULL DEFAULT 0;
ALTER TABLE ranks ADD COLUMN warning TEXT;
ALTER TABLE ranks ADD COLUMN warning_step INTEGER;
ALTER TABLE ranks ADD COLUMN first_overflow INTEGER;
ALTER TABLE ranks ADD COLUMN first_overflow_time REAL;
ALTER TABLE ranks ADD COLUMN placement TEXT;
ALTER TABLE ranks ADD COLUMN placement_step INTEGER;
ALTER TABLE events ADD COLUMN step_time_s REAL;
ALTER TABLE events ADD COLUMN sent_bytes INTEGER;
ALTER TABLE events ADD COLUMN moved_bytes INTEGER;
ALTER TABLE events ADD COLUMN mem_device INTEGER;
ALTER TABLE events ADD COLUMN mem_host INTEGER;
ALTER TABLE events ADD COLUMN overflow INTEGER;
UPDATE events SET
    step_time_s = json_extract(body, '$.step_time_s'),
    sent_bytes = (SELECT coalesce(sum(value), 0) FROM json_each(body, '$.comm_bytes')),
    moved_bytes = json_extract(body, '$.moved_bytes.to_device')
        + json_extract(body, '$.moved_bytes.to_host'),
    mem_device = json_extract(body, '$.memory.device'),
    mem_host = json_extract(body, '$.memory.host'),
    overflow = json_extract(body, '$.overflow')
WHERE type = 'step';
UPDATE ranks SET first_overflow = (
    SELECT min(step) FROM events e
    WHERE e.run_id = ranks.run_id AND e.rank = ranks.rank AND e.type = 'step' AND e.overflow
);
""",
    2: """
ALTER TABLE runs ADD COLUMN run_name TEXT;
ALTER TABLE runs ADD COLUMN entry_point TEXT;
ALTER TABLE runs ADD COLUMN script TEXT;
""",
}
