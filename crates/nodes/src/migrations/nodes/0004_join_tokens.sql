-- Join tokens: single use and expiring; a daemon presents one to join a pool. Only the secret's
-- SHA-256 is stored.
CREATE TABLE join_tokens (
  id text PRIMARY KEY,
  pool_id text NOT NULL REFERENCES pools,
  secret_sha256 bytea NOT NULL UNIQUE CHECK (length(secret_sha256) = 32),
  expires_at timestamptz NOT NULL,
  used_at timestamptz,
  used_by_node text,
  created_by text NOT NULL,
  created_at timestamptz NOT NULL DEFAULT compute_now()
);
CREATE INDEX join_tokens_pool ON join_tokens (pool_id);
