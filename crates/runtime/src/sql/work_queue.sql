-- The work queue's enqueue as a SQL function, so that a module whose writes run in the database (one
-- round trip per request, such as capacity's reservations) runs the very statement the Rust API runs:
-- work_queue::enqueue_stored calls it too. It returns a value, though no caller needs it: PL/pgSQL
-- runs `x := f(…)` as a plain expression, but `PERFORM f(…)` (the only way to call a void function)
-- as a query through the executor.

-- Enqueues (kind, key) pairs with their shards, due p_after_s from now; returns how many. A key
-- already queued gets its gen bumped and keeps the earlier time; while it is claimed, the time is
-- remembered for after the run (dirty_not_before).
CREATE OR REPLACE FUNCTION work_queue_enqueue(p_kinds text[], p_keys text[], p_shards int2[], p_after_s float8) RETURNS int
LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO work_queue AS w (kind, key, shard, not_before)
    SELECT k.kind, k.key, k.shard, compute_now() + make_interval(secs => p_after_s)
      FROM unnest(p_kinds, p_keys, p_shards) AS k(kind, key, shard)
     -- rows in (kind, key) order, so two transactions enqueueing overlapping keys cannot deadlock
     ORDER BY k.kind, k.key
    ON CONFLICT (kind, key) DO UPDATE
       SET gen = w.gen + 1,
           -- a key under a live claim is running: remember the time for after the run
           not_before = CASE WHEN w.claimed_until > compute_now() THEN w.not_before
                             ELSE LEAST(w.not_before, EXCLUDED.not_before) END,
           dirty_not_before = CASE WHEN w.claimed_until > compute_now()
                                   THEN LEAST(w.dirty_not_before, EXCLUDED.not_before)
                                   ELSE w.dirty_not_before END;
  RETURN cardinality(p_keys);
END $$;

-- desired::invalidate_many as a SQL function: wakes the NodeSpec controller (desired::NODESPEC, a
-- test keeps the name equal) for nodes in their stored shards, so that other modules' SQL wakes it
-- without naming the runtime's job.
CREATE OR REPLACE FUNCTION desired_invalidate(p_nodes text[], p_shards int2[]) RETURNS int
LANGUAGE sql AS $$
  SELECT work_queue_enqueue(array_fill('nodespec'::text, ARRAY[coalesce(cardinality(p_nodes), 0)]), p_nodes, p_shards, 0)
$$;
