-- Usage metering: one row per reservation (allocation) and closed usage window, written once with
-- its `usage.window` event; a late change (an extend into a closed window) adds an adjustment row,
-- never an edit. The row's id is the billing key `cmp:<allocationId>:<windowStart>` (with
-- `:<n>` for the n-th adjustment), so nothing is billed twice.

-- The fleet's window size: windows are aligned to it in UTC (a divisor of a day).
CREATE TABLE usage_settings (
  singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
  window_s integer NOT NULL DEFAULT 3600 CHECK (window_s >= 60 AND 86400 % window_s = 0)
);
INSERT INTO usage_settings DEFAULT VALUES;

CREATE TABLE usage_windows (
  id text PRIMARY KEY,
  allocation_id text NOT NULL,
  tenant_id text NOT NULL,
  pool_id text NOT NULL,
  node_id text,
  window_start timestamptz NOT NULL,
  window_end timestamptz NOT NULL CHECK (window_end > window_start),
  -- 0: the window's row; n: its n-th adjustment (a difference to add)
  adjustment integer NOT NULL CHECK (adjustment >= 0),
  gpu_kind text NOT NULL,
  gpu_model text NOT NULL,
  mig_profile text,
  -- exact seconds (microsecond precision) times the unit held
  atom_seconds numeric NOT NULL,
  vcpu_seconds numeric NOT NULL,
  memory_mib_seconds numeric NOT NULL,
  disk_gib_seconds numeric NOT NULL,
  closed_at timestamptz NOT NULL DEFAULT compute_now(),
  UNIQUE (allocation_id, window_start, adjustment),
  -- An allocation's windows never overlap.
  EXCLUDE USING gist (allocation_id WITH =, tstzrange(window_start, window_end) WITH &&) WHERE (adjustment = 0)
);
CREATE INDEX usage_windows_tenant ON usage_windows (tenant_id, window_start);

-- How far each reservation is metered: every window that ends by usage_closed_until was looked at
-- while the reservation had usage_version.
ALTER TABLE reservations ADD COLUMN usage_closed_until timestamptz;
ALTER TABLE reservations ADD COLUMN usage_version bigint;
CREATE INDEX reservations_usage ON reservations (pool_id, usage_closed_until) WHERE state <> 'pending';
