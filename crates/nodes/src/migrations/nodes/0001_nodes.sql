-- The nodes module's tables: the inventory capacity books from (sites, pools, nodes, devices),
-- one-shot commands, join tokens, node certificates and sessions, liveness.
-- The lock order across modules is in docs/architecture.md.

CREATE TABLE sites (
  id text PRIMARY KEY,
  name text NOT NULL UNIQUE CHECK (name ~ '^[a-z0-9][a-z0-9-]{0,62}$'),
  version bigint NOT NULL DEFAULT 1,
  created_at timestamptz NOT NULL DEFAULT compute_now()
);

CREATE TABLE pools (
  id text PRIMARY KEY,
  site_id text NOT NULL REFERENCES sites,
  name text NOT NULL CHECK (name ~ '^[a-z0-9][a-z0-9-]{0,62}$'),
  kind text NOT NULL CHECK (kind IN ('bare-metal', 'provider', 'vps-host')),
  -- overcommit: a node may hand out floor(allocatable * ratio)
  vcpu_ratio float8 NOT NULL DEFAULT 1 CHECK (vcpu_ratio >= 1 AND vcpu_ratio <= 16),
  memory_ratio float8 NOT NULL DEFAULT 1 CHECK (memory_ratio >= 1 AND memory_ratio <= 4),
  disk_ratio float8 NOT NULL DEFAULT 1 CHECK (disk_ratio >= 1 AND disk_ratio <= 4),
  -- unreachable -> lost after this long; only provider and vps-host pools, never bare metal
  lost_after_s integer CHECK (lost_after_s IS NULL OR (lost_after_s > 0 AND kind IN ('provider', 'vps-host'))),
  version bigint NOT NULL DEFAULT 1,
  created_at timestamptz NOT NULL DEFAULT compute_now(),
  UNIQUE (site_id, name)
);

CREATE TABLE nodes (
  id text PRIMARY KEY,
  pool_id text NOT NULL REFERENCES pools,
  name text NOT NULL,
  shard smallint NOT NULL CHECK (shard BETWEEN 0 AND 255),
  -- the node's hardware as registered; capacity books against it (its node_resources row)
  vcpu integer NOT NULL CHECK (vcpu >= 0),
  memory_mib bigint NOT NULL CHECK (memory_mib >= 0),
  disk_gib bigint NOT NULL CHECK (disk_gib >= 0),
  labels jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(labels) = 'object'),
  -- [{"key": "...", "value": "..."}]: a node with a taint takes only reservations that tolerate it
  taints jsonb NOT NULL DEFAULT '[]' CHECK (jsonb_typeof(taints) = 'array'),
  -- why the placer must skip the node: cordoned, unreachable, lost, draining, ...
  no_schedule_reasons text[] NOT NULL DEFAULT '{}',
  liveness text NOT NULL DEFAULT 'disconnected'
    CHECK (liveness IN ('connected', 'disconnected', 'unreachable', 'lost')),
  generation bigint NOT NULL DEFAULT 0 CHECK (generation >= 0),
  observed_generation bigint NOT NULL DEFAULT 0 CHECK (observed_generation >= 0),
  spec jsonb,
  version bigint NOT NULL DEFAULT 1,
  created_at timestamptz NOT NULL DEFAULT compute_now(),
  -- the seq of the node's next command (commands.seq)
  next_cmd_seq bigint NOT NULL DEFAULT 1 CHECK (next_cmd_seq >= 1),
  -- when the node joined: the time of its newest certificate; NULL for nodes registered by hand
  joined_at timestamptz,
  -- since when the node has had its current liveness, and the extra grace of the current
  -- disconnection (120 s after a gateway loss) before it counts as unreachable
  liveness_since timestamptz NOT NULL DEFAULT compute_now(),
  disconnect_grace_s integer NOT NULL DEFAULT 0 CHECK (disconnect_grace_s >= 0),
  -- what the daemon last reported: each section's outcome, and its inventory
  spec_status jsonb,
  reported_inventory jsonb,
  UNIQUE (pool_id, name)
);
CREATE INDEX nodes_pool ON nodes (pool_id);

-- Physical GPUs (parent_id IS NULL) and their atoms: MIG instances and shared slots are child rows.
-- The atom rule: a GPU in exclusive mode is itself the one atom; a MIG, time-slice or MPS GPU is
-- never bookable, only its active children are.
CREATE TABLE devices (
  id text PRIMARY KEY,
  node_id text NOT NULL REFERENCES nodes,
  parent_id text REFERENCES devices,
  kind text NOT NULL CHECK (kind IN ('gpu', 'mig', 'slot')),
  index smallint NOT NULL CHECK (index >= 0),
  model text NOT NULL,
  profile text,
  memory_mib integer NOT NULL CHECK (memory_mib > 0),
  healthy boolean NOT NULL DEFAULT true,
  quarantined boolean NOT NULL DEFAULT false,
  quarantine_reason text,
  mode text CHECK (mode IN ('exclusive', 'mig', 'time-slice', 'mps')),
  mig_layout text[] NOT NULL DEFAULT '{}',
  slots smallint NOT NULL DEFAULT 0 CHECK (slots >= 0),
  active boolean NOT NULL DEFAULT true,
  bookable boolean GENERATED ALWAYS AS (active AND (parent_id IS NOT NULL OR mode = 'exclusive')) STORED,
  version bigint NOT NULL DEFAULT 1,
  CHECK ((kind = 'gpu') = (parent_id IS NULL)),
  CHECK ((kind = 'gpu') = (mode IS NOT NULL)),
  CHECK ((kind = 'mig') = (profile IS NOT NULL)),
  CHECK (kind <> 'gpu' OR (mode = 'mig') = (cardinality(mig_layout) > 0)),
  CHECK (kind <> 'gpu' OR (mode IN ('time-slice', 'mps')) = (slots > 0))
);
CREATE UNIQUE INDEX devices_gpu_index ON devices (node_id, index) WHERE parent_id IS NULL;
CREATE INDEX devices_children ON devices (parent_id) WHERE parent_id IS NOT NULL;
CREATE INDEX devices_bookable ON devices (node_id, kind) WHERE bookable;

-- One-shot commands to nodes: durable rows written in the caller's transaction.
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
