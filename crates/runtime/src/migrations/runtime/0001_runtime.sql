-- The runtime's tables: the work queue and job reports, the outbox and its sinks' cursors.

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

-- Events leave through the outbox, written in the transaction of the change they describe.
-- Readers take only rows whose transaction is older than every running one (txid below the
-- snapshot's xmin), in (txid, seq) order, so a row that commits late is never skipped.
CREATE TABLE outbox (
  txid xid8 NOT NULL DEFAULT pg_current_xact_id(),
  seq bigint GENERATED ALWAYS AS IDENTITY,
  id text NOT NULL UNIQUE,
  type text NOT NULL,
  tenant_id text,
  subject text NOT NULL,
  data jsonb NOT NULL,
  time timestamptz NOT NULL DEFAULT compute_now(),
  PRIMARY KEY (txid, seq)
);

-- Where each sink has got to; saved after every delivered batch by the sink's lease holder.
CREATE TABLE outbox_cursors (
  sink text PRIMARY KEY,
  txid xid8 NOT NULL,
  seq bigint NOT NULL,
  delivered bigint NOT NULL DEFAULT 0,
  updated_at timestamptz NOT NULL DEFAULT compute_now()
);

-- The work queue is a queue: every change upserts a key and every run updates or deletes it. Vacuum
-- it after 2% of it is dead instead of the default 20%, unthrottled, so claims do not walk dead keys
-- (as capacity does for the tables the placer churns).
ALTER TABLE work_queue SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 200,
                            autovacuum_vacuum_cost_delay = 0);
