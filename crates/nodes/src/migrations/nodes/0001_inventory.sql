-- The inventory capacity books from. Lock order for transactions that take several of these tables:
-- pools, nodes, devices, node_resources (after quota_usage, before pool_capacity_rollup).

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

-- vCPU, memory and disk are counters changed only by guarded updates; the CHECKs are the backstop.
CREATE TABLE node_resources (
  node_id text PRIMARY KEY REFERENCES nodes,
  vcpu_allocatable integer NOT NULL CHECK (vcpu_allocatable >= 0),
  vcpu_ratio float8 NOT NULL CHECK (vcpu_ratio >= 1),
  vcpu_allocated integer NOT NULL DEFAULT 0,
  memory_mib_allocatable bigint NOT NULL CHECK (memory_mib_allocatable >= 0),
  memory_ratio float8 NOT NULL CHECK (memory_ratio >= 1),
  memory_mib_allocated bigint NOT NULL DEFAULT 0,
  disk_gib_allocatable bigint NOT NULL CHECK (disk_gib_allocatable >= 0),
  disk_ratio float8 NOT NULL CHECK (disk_ratio >= 1),
  disk_gib_allocated bigint NOT NULL DEFAULT 0,
  CHECK (vcpu_allocated >= 0 AND vcpu_allocated <= floor(vcpu_allocatable * vcpu_ratio)),
  CHECK (memory_mib_allocated >= 0 AND memory_mib_allocated <= floor(memory_mib_allocatable * memory_ratio)),
  CHECK (disk_gib_allocated >= 0 AND disk_gib_allocated <= floor(disk_gib_allocatable * disk_ratio))
);
