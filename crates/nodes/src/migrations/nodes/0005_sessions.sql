-- Node identity, sessions and liveness. Lock order for transactions that take several of these:
-- nodes, node_sessions, commands (after pools and join_tokens).

-- The certificates the control plane's CA signed for nodes. The gateway finds a daemon's node by
-- its certificate's SHA-256, so it never has to trust a name inside the certificate alone.
CREATE TABLE node_certificates (
  fingerprint_sha256 bytea PRIMARY KEY CHECK (length(fingerprint_sha256) = 32),
  node_id text NOT NULL REFERENCES nodes,
  serial text NOT NULL,
  -- the certificate's own validity (wall-clock time, as TLS checks it)
  not_before timestamptz NOT NULL,
  not_after timestamptz NOT NULL,
  revoked_at timestamptz,
  created_at timestamptz NOT NULL DEFAULT compute_now()
);
CREATE INDEX node_certificates_node ON node_certificates (node_id, created_at DESC);

-- When the node joined: the time of its newest certificate. NULL for nodes registered by hand.
ALTER TABLE nodes ADD COLUMN joined_at timestamptz;
-- Since when the node has had its current liveness, and the extra grace of the current
-- disconnection (120 s after a gateway loss) before it counts as unreachable.
ALTER TABLE nodes ADD COLUMN liveness_since timestamptz NOT NULL DEFAULT compute_now();
ALTER TABLE nodes ADD COLUMN disconnect_grace_s integer NOT NULL DEFAULT 0 CHECK (disconnect_grace_s >= 0);
-- What the daemon last reported: each section's outcome, and its inventory.
ALTER TABLE nodes ADD COLUMN spec_status jsonb;
ALTER TABLE nodes ADD COLUMN reported_inventory jsonb;

-- The node's one session. Each Hello bumps session_epoch; every write a gateway makes for the
-- node carries `AND session_epoch = $epoch`, so a superseded (zombie) gateway changes nothing.
CREATE TABLE node_sessions (
  node_id text PRIMARY KEY REFERENCES nodes,
  session_epoch bigint NOT NULL CHECK (session_epoch >= 1),
  gateway_id text NOT NULL,
  boot_id text NOT NULL,
  journal_id text NOT NULL,
  daemon_version text NOT NULL,
  opened_at timestamptz NOT NULL,
  last_seen_at timestamptz NOT NULL,
  closed_at timestamptz,
  close_reason text,
  CHECK ((closed_at IS NULL) = (close_reason IS NULL))
);
CREATE INDEX node_sessions_gateway ON node_sessions (gateway_id) WHERE closed_at IS NULL;

-- The liveness job's own heartbeat: a gap between its runs means the database or the controllers
-- were down, and every node then gets 5 minutes before it can become unreachable.
CREATE TABLE liveness_runs (
  singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
  last_run_at timestamptz NOT NULL,
  outage_grace_until timestamptz NOT NULL
);
