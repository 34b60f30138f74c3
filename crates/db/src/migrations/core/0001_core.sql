-- The core tables every module builds on: leases, workers, idempotency keys. The clock
-- (compute_now) comes before, in the clock module, because their defaults read it.

-- Exclusion constraints on (text, range), such as capacity's bookings, need btree_gist.
CREATE EXTENSION IF NOT EXISTS btree_gist;

-- Leases are rows, not advisory locks: they survive PgBouncer's transaction pooling and carry both a
-- time to live and an epoch that fences a holder that lost them.
CREATE TABLE leases (
  name text PRIMARY KEY CHECK (name <> ''),
  owner text NOT NULL CHECK (owner <> ''),
  epoch bigint NOT NULL CHECK (epoch >= 1),
  expires_at timestamptz NOT NULL
);

-- Live server processes; shards are divided among the rows that heartbeat.
CREATE TABLE workers (
  id text PRIMARY KEY,
  hostname text NOT NULL,
  pid integer NOT NULL,
  roles text[] NOT NULL,
  version text NOT NULL,
  started_at timestamptz NOT NULL DEFAULT compute_now(),
  heartbeat_at timestamptz NOT NULL DEFAULT compute_now(),
  -- the worker's self-checks (clock.skew), written at every heartbeat, so `jobs` shows them
  checks jsonb NOT NULL DEFAULT '[]' CHECK (jsonb_typeof(checks) = 'array')
);
CREATE INDEX workers_heartbeat_at ON workers (heartbeat_at);

-- A retried request with the same key returns the first result instead of acting twice. Keys are
-- scoped to (tenant, identity, key), so another identity cannot squat or read someone else's key.
CREATE TABLE idempotency_keys (
  tenant_id text NOT NULL,
  identity_id text NOT NULL,
  key text NOT NULL CHECK (length(key) BETWEEN 1 AND 255),
  method text NOT NULL,
  request_sha256 bytea NOT NULL CHECK (length(request_sha256) = 32),
  response jsonb,
  created_at timestamptz NOT NULL DEFAULT compute_now(),
  expires_at timestamptz NOT NULL,
  PRIMARY KEY (tenant_id, identity_id, key)
);
CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);
