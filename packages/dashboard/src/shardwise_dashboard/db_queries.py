"""The SQL statements the run store issues, beside the tables they read and write
(db_schema.py)."""

UPSERT_RUN = """
INSERT INTO runs (run_id, started, last_seen, received)
VALUES (:run_id, :first, :last, :received)
ON CONFLICT (run_id) DO UPDATE SET
    started = min(runs.started, excluded.started),
    last_seen = max(runs.last_seen, excluded.last_seen),
    received = max(coalesce(runs.received, 0), excluded.received)
"""

DESCRIBE_RUN = """
UPDATE runs SET world_size = :world_size, num_params = :num_params, config = :config,
    run_name = :run_name, entry_point = :entry_point, script = :script
WHERE run_id = :run_id
"""

# In an UPDATE every right-hand side reads the row as it was, so the comparisons below all
# see the stored values, not ones set earlier in the same statement.
UPSERT_RANK = """
INSERT INTO ranks (run_id, rank, status, error, host, last_step, num_steps, dropped, last_seen,
                   received, skipped_in_a_row, warning, warning_step, first_overflow,
                   first_overflow_time, placement, placement_step)
VALUES (:run_id, :rank, coalesce(:status, 'running'), :error, :host, :last_step, :num_steps,
        :dropped, :last_seen, :received, :skipped_in_a_row, :warning, :warning_step,
        :first_overflow, :first_overflow_time, :placement, :placement_step)
ON CONFLICT (run_id, rank) DO UPDATE SET
    status = coalesce(:status, ranks.status),
    error = coalesce(:error, ranks.error),
    host = coalesce(:host, ranks.host),
    last_step = max(ranks.last_step, :last_step),
    num_steps = ranks.num_steps + :num_steps,
    dropped = ranks.dropped + :dropped,
    last_seen = max(ranks.last_seen, :last_seen),
    received = max(coalesce(ranks.received, 0), :received),
    skipped_in_a_row = CASE WHEN :last_step >= ranks.last_step THEN :skipped_in_a_row
                            ELSE ranks.skipped_in_a_row END,
    warning = CASE WHEN :warning_step > coalesce(ranks.warning_step, -1) THEN :warning
                   ELSE ranks.warning END,
    warning_step = nullif(max(coalesce(ranks.warning_step, -1), coalesce(:warning_step, -1)), -1),
    first_overflow_time = CASE
        WHEN :first_overflow IS NOT NULL
             AND :first_overflow < coalesce(ranks.first_overflow, :first_overflow + 1)
        THEN :first_overflow_time ELSE ranks.first_overflow_time END,
    first_overflow = CASE
        WHEN :first_overflow IS NOT NULL
             AND :first_overflow < coalesce(ranks.first_overflow, :first_overflow + 1)
        THEN :first_overflow ELSE ranks.first_overflow END,
    placement = CASE WHEN :placement_step >= coalesce(ranks.placement_step, -1) THEN :placement
                     ELSE ranks.placement END,
    placement_step = nullif(
        max(coalesce(ranks.placement_step, -1), coalesce(:placement_step, -1)), -1
    )
"""

RUN_SUMMARIES = """
SELECT r.run_id, r.started, r.last_seen, r.world_size, r.num_params,
       count(k.rank), coalesce(sum(k.status = 'finished'), 0),
       coalesce(sum(k.status = 'failed'), 0), coalesce(max(k.last_step), -1),
       coalesce(sum(k.dropped), 0), coalesce(r.received, r.last_seen),
       coalesce(sum(k.warning IS NOT NULL), 0), r.run_name, r.entry_point, r.script
FROM runs r LEFT JOIN ranks k ON k.run_id = r.run_id
{where}
GROUP BY r.run_id ORDER BY r.started DESC, r.run_id
"""

RANKS = """
SELECT rank, status, error, host, last_step, num_steps, dropped, last_seen,
       coalesce(received, last_seen), skipped_in_a_row, warning, warning_step,
       first_overflow, first_overflow_time, placement, placement_step
FROM ranks WHERE run_id = ? {where} ORDER BY rank
"""

# Every k-th step of each rank, k = ceil(steps / max_points), plus its last and its overflows.
THINNED_STEPS = """
SELECT e.rank, e.body FROM events e
JOIN ranks k ON k.run_id = e.run_id AND k.rank = e.rank
WHERE e.run_id = ?1 AND e.type = 'step' {rank} AND (
    e.step % max(1, (k.last_step + ?2) / ?3) = 0
    OR e.step = k.last_step
    OR e.overflow
)
ORDER BY e.rank, e.step, e.id
"""

# Each rank's evaluations, thinned to about ?2 (every k-th by position, not by step: they come
# every so many steps, at steps a step-based stride could miss all of) and its latest.
EVALS = """
SELECT rank, body FROM (
    SELECT rank, step, id, body,
           row_number() OVER (PARTITION BY rank ORDER BY step, id) AS n,
           count(*) OVER (PARTITION BY rank) AS total
    FROM events WHERE run_id = ?1 AND type = 'eval' {rank}
) WHERE (n - 1) % max(1, (total + ?2 - 1) / ?2) = 0 OR n = total
ORDER BY rank, step, id
"""

# Letters of a chunk in `ranks.placement`: where its 16-bit payload is, and whether it is
# gathered (upper case) or only this rank's shard is held (lower case).
