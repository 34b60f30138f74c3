-- One-shot commands to nodes: durable rows written in the caller's transaction.
ALTER TABLE nodes ADD COLUMN next_cmd_seq bigint NOT NULL DEFAULT 1 CHECK (next_cmd_seq >= 1);

CREATE TABLE commands (
  id text PRIMARY KEY,
  node_id text NOT NULL REFERENCES nodes,
  -- the node's own order of commands, from nodes.next_cmd_seq
  seq bigint NOT NULL CHECK (seq >= 1),
  kind text NOT NULL,
  lane text NOT NULL,
  -- the protobuf CommandBody the daemon receives, and its payload as proto3 JSON for people
  body bytea NOT NULL,
  payload jsonb NOT NULL,
  idempotency_key text NOT NULL CHECK (idempotency_key <> ''),
  min_generation bigint NOT NULL DEFAULT 0 CHECK (min_generation >= 0),
  not_after timestamptz NOT NULL,
  timeout_s integer NOT NULL CHECK (timeout_s > 0),
  retry_safe boolean NOT NULL,
  self_terminating boolean NOT NULL,
  state text NOT NULL CHECK (state IN ('pending', 'sent', 'running', 'succeeded', 'failed', 'expired', 'cancelled')),
  reason text,
  result jsonb,
  -- BUSY rejections so far, and when a pending command may be sent again
  busy_count integer NOT NULL DEFAULT 0,
  not_before timestamptz NOT NULL DEFAULT compute_now(),
  cancel_requested boolean NOT NULL DEFAULT false,
  -- the controller to wake when it ends (kind, key and shard of its work queue row)
  owner_kind text,
  owner_key text,
  owner_shard smallint,
  requested_by text,
  created_at timestamptz NOT NULL DEFAULT compute_now(),
  sent_at timestamptz,
  finished_at timestamptz,
  version bigint NOT NULL DEFAULT 1,
  UNIQUE (node_id, seq),
  UNIQUE (node_id, idempotency_key),
  CHECK ((owner_kind IS NULL) = (owner_key IS NULL) AND (owner_key IS NULL) = (owner_shard IS NULL)),
  CHECK (state NOT IN ('failed', 'expired') OR reason IS NOT NULL)
);
CREATE INDEX commands_open ON commands (not_after) WHERE state IN ('pending', 'sent', 'running');
CREATE INDEX commands_node_pending ON commands (node_id, seq) WHERE state = 'pending';
