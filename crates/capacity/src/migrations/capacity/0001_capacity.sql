-- Placement by node selector starts from the nodes that carry the labels.
CREATE INDEX nodes_labels ON nodes USING gin (labels jsonb_path_ops);

-- Lock order for every transaction that takes several of these tables (reserve, release, extend,
-- retry, mode change): reservations (the one being changed), quota_usage, pools, nodes, devices,
-- node_resources, node_atom_counts, pool_capacity_rollup. Reserving charges quota first; releasing
-- refunds it first.

-- Every claim on an atom is a row here, and the database refuses overlapping rows whatever the
-- placer, the API or a buggy module does. device_id names an atom: a row of devices.
CREATE TABLE device_bookings (
  device_id text NOT NULL REFERENCES devices,
  allocation_id text NOT NULL,
  during tstzrange NOT NULL CHECK (NOT isempty(during)),
  EXCLUDE USING gist (device_id WITH =, during WITH &&)
);
CREATE INDEX device_bookings_allocation ON device_bookings (allocation_id);

-- Quota: changed only by the guarded UPDATE (used + n <= max); the CHECK is the backstop.
CREATE TABLE quota_usage (
  tenant_id text NOT NULL,
  resource text NOT NULL CHECK (resource IN ('gpus', 'mig_instances', 'gpu_slots', 'vcpu', 'memory_mib', 'disk_gib')),
  used bigint NOT NULL DEFAULT 0,
  max bigint NOT NULL CHECK (max >= 0),
  PRIMARY KEY (tenant_id, resource),
  CHECK (used >= 0 AND used <= max)
);

CREATE TABLE reservations (
  id text PRIMARY KEY,
  tenant_id text NOT NULL,
  pool_id text NOT NULL REFERENCES pools,
  state text NOT NULL CHECK (state IN ('pending', 'placed', 'active', 'released', 'expired', 'failed')),
  version bigint NOT NULL DEFAULT 1,
  gpu_kind text NOT NULL CHECK (gpu_kind IN ('gpu', 'mig', 'slot')),
  gpu_model text NOT NULL,
  mig_profile text,
  gpu_count integer NOT NULL CHECK (gpu_count >= 0),
  vcpu integer NOT NULL CHECK (vcpu >= 0),
  memory_mib bigint NOT NULL CHECK (memory_mib >= 0),
  disk_gib bigint NOT NULL CHECK (disk_gib >= 0),
  during tstzrange NOT NULL CHECK (NOT isempty(during) AND NOT lower_inf(during) AND NOT upper_inf(during)),
  node_selector jsonb NOT NULL DEFAULT '{}',
  tolerations jsonb NOT NULL DEFAULT '[]',
  node_id text REFERENCES nodes,
  -- {reason, message, since} while pending: why it could not be placed yet
  unschedulable jsonb,
  next_attempt_at timestamptz,
  created_by text NOT NULL,
  created_at timestamptz NOT NULL DEFAULT compute_now(),
  updated_at timestamptz NOT NULL DEFAULT compute_now(),
  CHECK ((gpu_kind = 'mig') = (mig_profile IS NOT NULL)),
  CHECK (state NOT IN ('placed', 'active') OR node_id IS NOT NULL),
  CHECK (state <> 'pending' OR (unschedulable IS NOT NULL AND next_attempt_at IS NOT NULL))
);
CREATE INDEX reservations_tenant ON reservations (tenant_id, id);
CREATE INDEX reservations_live ON reservations (pool_id) WHERE state IN ('pending', 'placed', 'active');

-- Per node and atom class: atoms that could be booked (bookable, healthy, not quarantined) and how
-- many of them have no current or future booking. A hint that lets the placer find candidates by
-- index instead of scanning the pool; bookings stay the truth.
CREATE TABLE node_atom_counts (
  node_id text NOT NULL REFERENCES nodes,
  pool_id text NOT NULL,
  kind text NOT NULL,
  model text NOT NULL,
  profile text NOT NULL DEFAULT '',
  total integer NOT NULL CHECK (total >= 0),
  idle integer NOT NULL CHECK (idle >= 0 AND idle <= total),
  PRIMARY KEY (node_id, kind, model, profile)
);
CREATE INDEX node_atom_counts_fit ON node_atom_counts (pool_id, kind, model, profile, idle, node_id);
CREATE INDEX node_atom_counts_total ON node_atom_counts (pool_id, kind, model, profile, total);

-- What a pool has, kept true by capacity.rollup: atoms per class, schedulable nodes, free scalars.
CREATE TABLE pool_capacity_rollup (
  pool_id text PRIMARY KEY REFERENCES pools,
  atoms jsonb NOT NULL,
  nodes integer NOT NULL,
  schedulable_nodes integer NOT NULL,
  vcpu_free bigint NOT NULL,
  memory_mib_free bigint NOT NULL,
  disk_gib_free bigint NOT NULL,
  updated_at timestamptz NOT NULL
);

-- Recomputes a node's atom counts from its devices and bookings. Upserts (never delete-and-insert),
-- so two transactions refreshing the same node at once cannot collide on the primary key.
CREATE FUNCTION capacity_refresh_node_counts(p_node text) RETURNS void LANGUAGE sql AS $$
  WITH fresh AS (
    SELECT a.node_id, n.pool_id, a.kind, a.model, coalesce(a.profile, '') AS profile, count(*)::int AS total,
           (count(*) FILTER (WHERE NOT EXISTS (
              SELECT 1 FROM device_bookings b WHERE b.device_id = a.id AND upper(b.during) > compute_now())))::int AS idle
      FROM devices a
      JOIN devices g ON g.id = coalesce(a.parent_id, a.id)
      JOIN nodes n ON n.id = a.node_id
     WHERE a.node_id = p_node AND a.bookable AND g.healthy AND NOT g.quarantined
     GROUP BY a.node_id, n.pool_id, a.kind, a.model, coalesce(a.profile, '')),
  up AS (
    INSERT INTO node_atom_counts (node_id, pool_id, kind, model, profile, total, idle)
    SELECT * FROM fresh
    ON CONFLICT (node_id, kind, model, profile)
      DO UPDATE SET pool_id = EXCLUDED.pool_id, total = EXCLUDED.total, idle = EXCLUDED.idle)
  UPDATE node_atom_counts c SET total = 0, idle = 0
   WHERE c.node_id = p_node AND c.total > 0
     AND NOT EXISTS (SELECT 1 FROM fresh f WHERE f.kind = c.kind AND f.model = c.model AND f.profile = c.profile);
$$;
