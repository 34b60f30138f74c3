-- The audit log (entry.rs, checkpoint.rs). An entry is written in the transaction that makes the
-- change (or, for a refusal, in one of its own) with no place in the log yet: `audit.checkpoint`
-- later gives entries their log index and chain hash in the outbox's order (transaction id, then
-- position), taking only entries older than every running transaction, so none can appear behind
-- one it placed and no write waits on a log-wide lock.
CREATE TABLE audit_entries (
  id text PRIMARY KEY,
  txid xid8 NOT NULL DEFAULT pg_current_xact_id(),
  position bigint GENERATED ALWAYS AS IDENTITY,
  at timestamptz NOT NULL DEFAULT compute_now(),
  -- identity: a person or service through the API (token_id set); job: a job of the control
  -- plane (actor_id is the job's kind); system: the control plane itself
  actor_kind text NOT NULL CHECK (actor_kind IN ('identity', 'job', 'system')),
  actor_id text NOT NULL CHECK (length(actor_id) BETWEEN 1 AND 200),
  token_id text CHECK (length(token_id) <= 64),
  tenant_id text CHECK (length(tenant_id) <= 64),
  action text NOT NULL CHECK (length(action) BETWEEN 1 AND 100),
  target text NOT NULL CHECK (length(target) <= 500),
  request_id text CHECK (length(request_id) <= 64),
  source text CHECK (length(source) <= 100),
  outcome text NOT NULL CHECK (outcome IN ('ok', 'denied')),
  -- sha256 of the request's body, hex
  request_digest text CHECK (request_digest ~ '^[0-9a-f]{64}$'),
  log_index bigint UNIQUE CHECK (log_index >= 0),
  chain_hash bytea CHECK (octet_length(chain_hash) = 32),
  CHECK ((log_index IS NULL) = (chain_hash IS NULL))
);
CREATE INDEX audit_entries_unplaced ON audit_entries (txid, position) WHERE log_index IS NULL;
CREATE INDEX audit_entries_tenant ON audit_entries (tenant_id, log_index);

-- A signed statement of the log so far: its size, Merkle root and last chain hash, with the
-- frontier (the perfect subtrees' roots) the next checkpoint extends.
CREATE TABLE audit_checkpoints (
  tree_size bigint PRIMARY KEY CHECK (tree_size > 0),
  root bytea NOT NULL CHECK (octet_length(root) = 32),
  chain_hash bytea NOT NULL CHECK (octet_length(chain_hash) = 32),
  frontier bytea[] NOT NULL,
  public_key bytea CHECK (octet_length(public_key) = 32),
  signature bytea CHECK (octet_length(signature) = 64),
  at timestamptz NOT NULL DEFAULT compute_now()
);
