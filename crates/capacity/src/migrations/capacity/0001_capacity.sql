-- The capacity module's tables: bookings of atoms (live, under the exclusion constraint, and
-- ended), quota, reservations, and the placer's hints (node_atom_counts, pool_capacity_rollup).
-- Its functions are in crates/capacity/src/sql/; the lock order across modules is in docs/architecture.md.

-- Placement by node selector starts from the nodes that carry the labels.
CREATE INDEX nodes_labels ON nodes USING gin (labels jsonb_path_ops);

-- Every claim on an atom is a row here, and the database refuses overlapping rows whatever the
-- placer, the API or a buggy module does. device_id names an atom: a row of devices.
CREATE TABLE device_bookings (
  device_id text NOT NULL REFERENCES devices,
  allocation_id text NOT NULL,
  during tstzrange NOT NULL CHECK (NOT isempty(during)),
  EXCLUDE USING gist (device_id WITH =, during WITH &&)
);
CREATE INDEX device_bookings_allocation ON device_bookings (allocation_id);

-- One atom's bookings by end, for "is this atom booked in this range" (the placer) and "has it
-- anything booked from now on" (release, expiry, the idle counts). Its device_id is in the "C"
-- collation, and so are the lookups that should use it: the exclusion constraint's GiST indexes
-- device_id in the default collation, so it cannot serve them. btree_gist keeps a range of text
-- keys per page, the ranges overlap, and an equality reads most of that index (a millisecond per
-- lookup once bookings pile up), which the planner's estimates do not show; and plans made from
-- statistics of a nearly empty table read every live booking of the table for each atom. With one
-- index to choose, and the lookups written as scalar subqueries (run per atom, the atom's id in the
-- index condition), neither can happen. Equality on text is byte equality in every deterministic
-- collation, so the answers are the same.
CREATE INDEX device_bookings_atom_end ON device_bookings (device_id COLLATE "C", upper(during));

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
  -- whether the node takes a request that tolerates nothing (capacity_node_open, counts.sql)
  open boolean NOT NULL DEFAULT false,
  PRIMARY KEY (node_id, kind, model, profile)
);

-- The class, then open or not, then the fit order: a request without tolerations walks one range.
CREATE INDEX node_atom_counts_fit ON node_atom_counts (pool_id, kind, model, profile, open, idle, node_id);
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

-- Ended bookings leave device_bookings for device_booking_history.
--
-- The exclusion constraint guards live bookings: every booking is inserted starting at or after
-- compute_now(), so one that has ended can never conflict again. Kept in device_bookings, every
-- reservation ever made would stay in the constraint's GiST and the bookings' btrees, which every
-- placement's insert and lookups walk: with 500,000 past bookings a create and its release run 12%
-- slower, and a server that places all day would grow the table without bound.
--
-- So ending a reservation (release, expiry: capacity_end) moves its bookings in one statement: what it held up to now goes to the history, cut there; what it had
-- booked from now on is deleted. The history is what a tenant held, for usage; nothing reads it
-- to decide a placement, and it has no exclusion constraint. A mode change moves its GPU's ended
-- change windows the same way (mode.rs), so each GPU keeps at most its last one.
--
-- An atom is free for a placement from the moment its release commits. A placement whose clock
-- read an earlier time (a transaction that began before the release, or the simulated clock before
-- a jump) may book the atom from that earlier instant, so its booking can overlap the released
-- one's history record by that much.

CREATE TABLE device_booking_history (
  device_id text NOT NULL,
  allocation_id text NOT NULL,
  during tstzrange NOT NULL CHECK (NOT isempty(during))
);

-- A reservation's atoms once it has ended (capacity_view).
CREATE INDEX device_booking_history_allocation ON device_booking_history (allocation_id);

-- A node's vCPU, memory and disk ledger: its hardware times its pool's ratios, and what is booked.
-- The row is made when the node is registered (capacity_node_registered, resources.sql); the
-- allocated counters change only by the placer's and the release's guarded updates, and the CHECKs
-- are the backstop.
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

-- Autovacuum for the tables every placement and release churns: at 2% of a table dead instead of
-- the default 20%, unthrottled. A release deletes or moves its bookings, and each placement and
-- release updates a node's scalars and atom counts and the tenant's quota; with the default
-- thresholds the dead versions pile up at the top of each atom's range in device_bookings_atom_end,
-- which the placer's atom lookup walks backwards, and a create-and-release pair slows by a quarter
-- (with autovacuum_naptime = 5s, docs/capacity.md).
ALTER TABLE device_bookings SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 200,
                                 autovacuum_vacuum_cost_delay = 0, autovacuum_analyze_scale_factor = 0.05);
ALTER TABLE reservations SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 200,
                              autovacuum_vacuum_cost_delay = 0);
ALTER TABLE quota_usage SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 200,
                             autovacuum_vacuum_cost_delay = 0);
ALTER TABLE node_atom_counts SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 200,
                                  autovacuum_vacuum_cost_delay = 0);
ALTER TABLE node_resources SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 200,
                                autovacuum_vacuum_cost_delay = 0);
