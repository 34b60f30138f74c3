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
  heartbeat_at timestamptz NOT NULL DEFAULT compute_now()
);
CREATE INDEX workers_heartbeat_at ON workers (heartbeat_at);
