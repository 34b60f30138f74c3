-- Wake-ups for reconcilers: one row per dirty (kind, key). Enqueueing a queued key bumps gen; a run
-- deletes the row only if gen did not move, so a key dirtied during its run runs again.
CREATE TABLE work_queue (
  kind text NOT NULL,
  key text NOT NULL,
  -- 0..255 for node- and pool-sharded kinds; -1 for a singleton kind's keys.
  shard smallint NOT NULL CHECK (shard BETWEEN -1 AND 255),
  gen bigint NOT NULL DEFAULT 1 CHECK (gen >= 1),
  not_before timestamptz NOT NULL,
  claimed_until timestamptz,
  claimed_by text,
  -- the earliest time asked for by enqueues made while the key was claimed; applied after the run
  dirty_not_before timestamptz,
  attempts integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
  last_error text,
  last_error_at timestamptz,
  enqueued_at timestamptz NOT NULL DEFAULT compute_now(),
  PRIMARY KEY (kind, key),
  CHECK ((claimed_until IS NULL) = (claimed_by IS NULL))
);
CREATE INDEX work_queue_due ON work_queue (kind, shard, not_before);

-- The last status of each job on each worker, for operators.
CREATE TABLE job_runs (
  job text NOT NULL,
  worker_id text NOT NULL,
  ticks bigint NOT NULL,
  last_tick_at timestamptz NOT NULL,
  last_report jsonb NOT NULL,
  last_error text,
  last_error_at timestamptz,
  PRIMARY KEY (job, worker_id)
);
