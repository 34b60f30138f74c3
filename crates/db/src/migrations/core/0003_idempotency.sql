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
